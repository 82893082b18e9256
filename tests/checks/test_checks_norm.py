"""GA201-GA205, GA210 and the seed fixture: which norm did clipping use?"""

import math

import torch
from builders import (
    assert_close,
    box,
    check,
    clip,
    codes,
    finding,
    sharded_rows,
    tensor_with_norm,
    whole,
    write_step,
)

from gradaudit.model import ClipRecord, Topology

NORM_CODES = {"GA201", "GA202", "GA203", "GA204", "GA205", "GA210"}


def four_shards_of_norm_08(dtype=torch.float64):
    return [tensor_with_norm(0.8, (2, 3), seed=r, dtype=dtype) for r in range(4)]


def test_seed_fixture_four_shards_below_threshold_are_diagnosed_as_local_clipping(tmp_path):
    sharded_rows(tmp_path, four_shards_of_norm_08(), clips=clip(1.0, reported_norm=0.8, clip_coef=1.0))
    report = check(tmp_path)
    assert abs(report.global_norm - 1.6) < 1e-6
    assert abs(report.expected_clip_coef - 0.625) < 1e-6
    assert {"GA201", "GA302"} <= codes(report)
    assert codes(report) & NORM_CODES == {"GA201"}
    assert finding(report, "GA201").ranks == (0, 1, 2, 3)
    assert [row.diagnosis for row in report.ranks] == ["local_only"] * 4
    assert "GA201" in report.verdict and "1.6" in report.verdict


def test_ranks_that_report_the_true_norm_and_apply_its_coefficient_raise_no_norm_finding(tmp_path):
    grads = four_shards_of_norm_08()
    true = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    coef = 1.0 / (true + 1e-6)
    sharded_rows(
        tmp_path,
        grads,
        clips=clip(1.0, reported_norm=true, clip_coef=coef),
        clipped=[g * coef for g in grads],
    )
    report = check(tmp_path)
    assert codes(report) & (NORM_CODES | {"GA301", "GA302", "GA303"}) == set()
    assert [row.diagnosis for row in report.ranks] == ["correct"] * 4
    assert "Clipping used the true global norm" in report.verdict


def _replicated(tmp_path, reported):
    g = tensor_with_norm(1.5, (3, 2), seed=7, dtype=torch.float64)
    write_step(
        tmp_path,
        world_size=2,
        params={"w": (3, 2)},
        pieces={r: [whole("w", grad=g.clone(), replica_group="dp")] for r in range(2)},
        clips=clip(1.0, reported_norm=reported),
        topology=Topology(groups={"dp": ((0, 1),)}),
    )
    return check(tmp_path)


def test_a_norm_summed_over_every_replica_is_diagnosed_as_double_counting(tmp_path):
    report = _replicated(tmp_path, reported=1.5 * math.sqrt(2))
    assert codes(report) & NORM_CODES == {"GA202"}
    assert_close(report.global_norm, 1.5)
    assert "GA302" in codes(report)


def test_replicas_counted_once_raise_no_double_counting(tmp_path):
    report = _replicated(tmp_path, reported=1.5)
    assert codes(report) & NORM_CODES == set()


def _two_stages(tmp_path, reported_by_rank):
    """Two pipeline stages (a on ranks 0-1, b on ranks 2-3), each stage sharded over dp_shard."""
    grads = {r: tensor_with_norm(0.5 + 0.25 * r, (2, 2), seed=r, dtype=torch.float64) for r in range(4)}
    pieces = {r: [box("a" if r < 2 else "b", ((r % 2) * 2, 0), grad=g)] for r, g in grads.items()}
    topology = Topology(groups={"dp_shard": ((0, 1), (2, 3)), "pp": ((0, 2), (1, 3))})
    write_step(
        tmp_path,
        world_size=4,
        params={"a": (4, 2), "b": (4, 2)},
        pieces=pieces,
        clips={r: clip(1.0, reported_norm=reported_by_rank(r, grads)) for r in range(4)},
        topology=topology,
    )
    return check(tmp_path), grads


def _norm(*tensors):
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def test_stages_clipping_by_their_own_stage_norm_are_diagnosed_as_the_wrong_group(tmp_path):
    report, _ = _two_stages(tmp_path, lambda r, g: _norm(g[2 * (r // 2)], g[2 * (r // 2) + 1]))
    found = finding(report, "GA203")
    assert found.evidence["group"] == "dp_shard" and found.ranks == (0, 1, 2, 3)
    assert codes(report) & NORM_CODES == {"GA203"}
    assert report.ranks[0].diagnosis == "wrong_group:dp_shard"


def test_stage_norms_all_reduced_over_the_data_parallel_group_name_that_group_not_every_copy(tmp_path):
    # Each rank holds its stage's full norm (a DTensor's, complete over dp_shard) and sums its square
    # over dp_shard instead of pp: sqrt(2) times the stage norm, which every_copy:dp_shard (GA202) matched.
    def stage_norm_twice(r, g):
        return math.sqrt(2) * _norm(g[2 * (r // 2)], g[2 * (r // 2) + 1])

    report, _ = _two_stages(tmp_path, stage_norm_twice)
    found = finding(report, "GA203")
    assert found.evidence["group"] == "dp_shard" and found.ranks == (0, 1, 2, 3)
    assert "'dp_shard'" in found.message and "summed over the group again" in found.message
    assert codes(report) & NORM_CODES == {"GA203"}
    assert {row.diagnosis for row in report.ranks} == {"wrong_group:dp_shard"}


def test_replicated_stage_norms_all_reduced_over_the_data_parallel_group_name_that_group(tmp_path):
    """Pipeline stages replicated over dp (DDP inside each stage): the local norms' squares summed over
    dp count each stage once per replica."""
    grads = {"a": tensor_with_norm(0.9, (2, 2), seed=1), "b": tensor_with_norm(1.2, (2, 2), seed=2)}
    pieces = {
        r: [whole("a" if r < 2 else "b", grad=grads["a" if r < 2 else "b"], replica_group="dp")]
        for r in range(4)
    }
    write_step(
        tmp_path,
        world_size=4,
        params={"a": (2, 2), "b": (2, 2)},
        pieces=pieces,
        clips={r: clip(1.0, reported_norm=math.sqrt(2) * (0.9 if r < 2 else 1.2)) for r in range(4)},
        topology=Topology(groups={"dp": ((0, 1), (2, 3)), "pp": ((0, 2), (1, 3))}),
    )
    report = check(tmp_path)
    assert codes(report) & NORM_CODES == {"GA203"}
    assert finding(report, "GA203").evidence["group"] == "dp"


def test_a_full_norm_summed_again_over_a_group_that_holds_every_element_stays_every_copy(tmp_path):
    """HSDP, 3 replicas of a 2-way shard: the full norm (complete over dp_shard) summed over dp_shard
    again is sqrt(2) times the true norm, every copy counted (sqrt(3) would be every replica)."""
    shards = [tensor_with_norm(0.6 + 0.3 * s, (2, 3), seed=s, dtype=torch.float64) for s in range(2)]
    true = _norm(*shards)
    write_step(
        tmp_path,
        world_size=6,
        params={"w": (4, 3)},
        pieces={
            r: [box("w", (2 * (r % 2), 0), grad=shards[r % 2], replica_group="dp_replicate")]
            for r in range(6)
        },
        clips=clip(1.0, reported_norm=math.sqrt(2) * true),
        topology=Topology(
            groups={"dp_shard": ((0, 1), (2, 3), (4, 5)), "dp_replicate": ((0, 2, 4), (1, 3, 5))}
        ),
    )
    report = check(tmp_path)
    assert codes(report) & NORM_CODES == {"GA202"}
    assert finding(report, "GA202").evidence["group"] == "dp_shard"


def _listed_twice(tmp_path, *, scaled_twice: bool):
    """`w` and `e` sharded by rows over 2 ranks; the reported norm counts `e` twice; `e` clipped by c²
    (listed twice, scaled twice) or, contradicting that, by c as `w`."""
    w = [tensor_with_norm(0.8 + 0.2 * r, (2, 3), seed=r, dtype=torch.float64) for r in range(2)]
    e = [tensor_with_norm(0.5 + 0.1 * r, (2, 3), seed=5 + r, dtype=torch.float64) for r in range(2)]
    reported = math.sqrt(_norm(*w, *e) ** 2 + _norm(*e) ** 2)
    coef = 1.0 / (reported + 1e-6)
    pieces = {
        r: [
            box("w", (2 * r, 0), grad=w[r], grad_clipped=w[r] * coef),
            box("e", (2 * r, 0), grad=e[r], grad_clipped=e[r] * (coef**2 if scaled_twice else coef)),
        ]
        for r in range(2)
    }
    write_step(
        tmp_path,
        world_size=2,
        params={"w": (4, 3), "e": (4, 3)},
        pieces=pieces,
        clips=clip(1.0, reported_norm=reported),
        topology=Topology(groups={"dp": ((0, 1),)}),
    )
    return check(tmp_path), reported


def test_a_parameter_listed_twice_in_the_clip_list_is_named_with_the_parameter(tmp_path):
    report, reported = _listed_twice(tmp_path, scaled_twice=True)
    assert codes(report) & NORM_CODES == {"GA210"} and "GA304" in codes(report)
    found = finding(report, "GA210")
    assert found.params == ("e",) and found.evidence["cause"] == "listed_twice" and found.ranks == (0, 1)
    assert_close(found.evidence["matched_norm"], reported, rel=1e-9)
    assert found.fix.startswith("List each parameter once")


def test_a_norm_with_a_parameter_counted_twice_whose_coefficients_say_otherwise_stays_unexplained(tmp_path):
    report, _ = _listed_twice(tmp_path, scaled_twice=False)
    assert codes(report) & NORM_CODES == {"GA204"}
    assert "listed_twice" not in finding(report, "GA204").message


def test_stages_that_reduce_over_every_stage_raise_no_group_finding(tmp_path):
    report, _ = _two_stages(tmp_path, lambda r, g: _norm(*g.values()))
    assert codes(report) & NORM_CODES == set()


def test_a_norm_that_matches_no_hypothesis_is_reported_with_its_numbers(tmp_path):
    sharded_rows(tmp_path, four_shards_of_norm_08(), clips=clip(1.0, reported_norm=3.7))
    report = check(tmp_path)
    found = finding(report, "GA204")
    assert "3.7" in found.message and "local_only 0.8" in found.message
    assert codes(report) & NORM_CODES == {"GA204"}


def test_a_wrong_logged_norm_with_right_coefficients_is_a_logging_bug_not_a_clipping_bug(tmp_path):
    grads = four_shards_of_norm_08()
    coef = 1.0 / (1.6 + 1e-6)
    sharded_rows(tmp_path, grads, clips=clip(1.0, reported_norm=0.8), clipped=[g * coef for g in grads])
    report = check(tmp_path)
    assert codes(report) & NORM_CODES == {"GA205"}
    assert "GA302" not in codes(report)
    assert {row.applied_coef_source for row in report.ranks} == {"gradients"}
    assert abs(report.ranks[0].applied_clip_coef - 0.625) < 1e-6


def test_reported_norm_right_but_coefficient_from_the_local_norm_is_diagnosed_from_the_coefficient(tmp_path):
    grads = [tensor_with_norm(1.5, (2, 3), seed=r, dtype=torch.float64) for r in range(2)]
    true = _norm(*grads)
    local_coef = 1.0 / (1.5 + 1e-6)
    sharded_rows(
        tmp_path, grads, clips=clip(1.0, reported_norm=true), clipped=[g * local_coef for g in grads]
    )
    report = check(tmp_path)
    assert codes(report) & NORM_CODES == {"GA201"}
    assert "GA302" in codes(report)


def test_world_size_one_says_local_and_global_cannot_be_told_apart(tmp_path):
    g = tensor_with_norm(2.0, (4,), dtype=torch.float64)
    write_step(
        tmp_path,
        world_size=1,
        params={"w": (4,)},
        pieces={0: [whole("w", grad=g)]},
        clips=clip(1.0, reported_norm=2.0),
    )
    report = check(tmp_path)
    assert report.ranks[0].diagnosis == "correct"
    # Said once, in the verdict it qualifies, rather than in every rank's explanation.
    assert "local_only" not in report.ranks[0].diagnosis_detail
    assert "a local-only norm would have been the same" in report.verdict
    assert codes(report) & NORM_CODES == set()


def test_a_norm_of_still_scaled_gradients_is_diagnosed_with_the_loss_scale(tmp_path):
    grads = four_shards_of_norm_08()
    record = ClipRecord(max_norm=1.0, reported_norm=1.6 * 1024, loss_scale=1024.0)
    sharded_rows(tmp_path, grads, clips=record)
    report = check(tmp_path)
    assert report.ranks[0].diagnosis == "loss_scaled:correct"
    assert "GA502" in codes(report)
    assert codes(report) & NORM_CODES == set()


def test_gradients_dumped_before_unscale_are_unscaled_and_a_scaled_local_norm_gives_both_findings(tmp_path):
    record = ClipRecord(max_norm=1.0, reported_norm=0.8 * 512, loss_scale=512.0, unscaled_before_clip=False)
    sharded_rows(tmp_path, [g * 512 for g in four_shards_of_norm_08()], clips=record)
    report = check(tmp_path)
    assert abs(report.global_norm - 1.6) < 1e-9
    assert {"GA201", "GA502"} <= codes(report)
    assert report.ranks[0].diagnosis == "loss_scaled:local_only"


def test_norm_checks_say_not_checked_without_a_clip_record_and_warn_that_clipping_was_not_checked(tmp_path):
    sharded_rows(tmp_path, four_shards_of_norm_08(), clips=None)
    report = check(tmp_path)
    assert {n.code for n in report.not_checked} >= NORM_CODES
    assert codes(report) == {"GA206"}
    assert "Clipping not checked: no rank recorded what its clipping did" in report.verdict
