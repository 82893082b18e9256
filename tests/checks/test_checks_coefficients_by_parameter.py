"""GA304: the coefficient each parameter received, measured from its pre- and post-clip gradients, and
the parameters named when one step's parameters received several (and GA301 left to per-rank ones)."""

import math

import pytest
import torch
from builders import box, check, clip, codes, finding, not_checked, tensor_with_norm, write_step

from gradaudit.model import ClipCall

MAX_NORM = 1.0


def _grads(seed: int) -> dict[str, torch.Tensor]:
    """Rank `seed`'s rows of two parameters, a (norm 1 per rank) and b (norm 0.5 per rank)."""
    return {
        "a": tensor_with_norm(1.0, (2, 3), seed=seed, dtype=torch.float64),
        "b": tensor_with_norm(0.5, (2,), seed=10 + seed, dtype=torch.float64),
    }


def _write(tmp_path, coefs: dict[str, float], *, stats_only: bool = False, holders=None, clips=None):
    """Two ranks, each holding rows of a and b (or, with `holders`, only the parameters listed for it),
    their post-clip gradients scaled by `coefs` per parameter (or per rank: a callable of the rank)."""
    pieces = {}
    for rank in range(2):
        grads = _grads(rank)
        specs = []
        for name, g in grads.items():
            if holders is not None and name not in holders[rank]:
                continue
            coef = coefs[name](rank) if callable(coefs[name]) else coefs[name]
            specs.append(
                box(
                    name,
                    (2 * rank,) + (0,) * (g.dim() - 1),
                    grad=g,
                    grad_clipped=g * coef,
                    stats_only=stats_only,
                )
            )
        pieces[rank] = specs
    return write_step(
        tmp_path,
        world_size=2,
        params={"a": (4, 3), "b": (4,)},
        pieces=pieces,
        clips=clips if clips is not None else clip(MAX_NORM),
    )


@pytest.mark.parametrize("stats_only", [False, True])
def test_a_parameter_scaled_twice_is_named_with_the_square_of_the_others_coefficient(tmp_path, stats_only):
    c = 0.4
    report = check(_write(tmp_path, {"a": c, "b": c * c}, stats_only=stats_only))
    found = finding(report, "GA304")
    assert found.params == ("b",) and found.ranks == (0, 1)
    assert found.evidence["cause"] == "listed_twice" and found.evidence["power"] == 2
    assert math.isclose(found.evidence["clip_coef"], c * c, rel_tol=1e-9)
    assert math.isclose(found.evidence["others_clip_coef"], c, rel_tol=1e-9)
    assert found.evidence["measured_from"] == ("sums of squares" if stats_only else "values")
    true_norm = math.sqrt(2 * 1.0 + 2 * 0.25)
    assert math.isclose(found.evidence["expected_clip_coef"], MAX_NORM / (true_norm + 1e-6), rel_tol=1e-9)
    counted_twice = math.sqrt(true_norm**2 + 2 * 0.25)  # b's squares once more
    assert f"{counted_twice:.6g}" in found.message and "listed twice in the clip list" in found.message
    assert "GA301" not in codes(report)  # each rank's mean over a and b is a number nobody received
    assert "GA302" in not_checked(report)
    assert "GA304" in report.verdict
    assert all(row.applied_clip_coef is None and "(GA304)" in row.diagnosis_detail for row in report.ranks)
    assert found.fix.startswith("List each parameter once: clip model.parameters()")


def test_a_parameter_left_unscaled_is_named_as_left_out_of_the_clip_list(tmp_path):
    found = finding(check(_write(tmp_path, {"a": 0.5, "b": 1.0})), "GA304")
    assert found.params == ("b",) and found.evidence["cause"] == "left_out"
    assert "not scaled at all" in found.message
    assert found.fix.startswith("Give the clip call every parameter")


def test_coefficients_that_match_no_cause_are_named_without_one(tmp_path):
    found = finding(check(_write(tmp_path, {"a": 0.5, "b": 0.7})), "GA304")
    assert found.evidence["cause"] == "unrecognised" and found.params == ("a",)  # of as many, the smaller


def test_one_coefficient_for_every_parameter_raises_no_ga304(tmp_path):
    true_norm = math.sqrt(2.5)
    coef = MAX_NORM / (true_norm + 1e-6)
    report = check(_write(tmp_path, {"a": coef, "b": coef}))
    assert not {"GA301", "GA302", "GA303", "GA304"} & codes(report)
    assert "GA304" not in not_checked(report)


def test_ranks_that_each_applied_one_coefficient_to_all_they_hold_are_ga301_not_ga304(tmp_path):
    """Pipeline stages clipping by their own norms: rank 0 holds a, rank 1 holds b."""
    report = check(_write(tmp_path, {"a": 0.5, "b": 0.8}, holders={0: {"a"}, 1: {"b"}}))
    assert "GA304" not in codes(report) and "GA301" in codes(report)


def test_a_parameter_whose_ranks_disagree_leaves_ga301_standing_beside_ga304(tmp_path):
    report = check(_write(tmp_path, {"a": lambda rank: 0.5 if rank == 0 else 0.6, "b": 0.25}))
    assert {"GA301", "GA304"} <= codes(report)


def test_without_post_clip_gradients_ga304_is_not_checked(tmp_path):
    pieces = {
        r: [box(n, (2 * r,) + (0,) * (g.dim() - 1), grad=g) for n, g in _grads(r).items()] for r in range(2)
    }
    report = check(
        write_step(
            tmp_path,
            world_size=2,
            params={"a": (4, 3), "b": (4,)},
            pieces=pieces,
            clips=clip(MAX_NORM, clip_coef=0.5),
        )
    )
    assert "GA304" in not_checked(report)


def _two_calls(
    tmp_path,
    after_first: dict[str, float],
    after_second: dict[str, float],
    *,
    grown: float = 1.0,
    reported: tuple[float, float] = (1.0, 2.0),
):
    """Two clip calls: the gradient before the second is the first's scaled by `after_first` (and
    multiplied by `grown`, as a backward between the calls does); the final one by `after_second` too.
    `reported`: the norm each call returned."""
    pieces = {}
    for rank in range(2):
        specs = []
        for name, g in _grads(rank).items():
            mid = g * after_first[name] * grown
            offsets = (2 * rank,) + (0,) * (g.dim() - 1)
            specs.append(
                box(name, offsets, grad=mid, grad_clipped=mid * after_second[name], call_stats=(g, mid))
            )
        pieces[rank] = specs
    calls = tuple(ClipCall(reported_norm=n, max_norm=MAX_NORM) for n in reported)
    return write_step(
        tmp_path,
        world_size=2,
        params={"a": (4, 3), "b": (4,)},
        pieces=pieces,
        clips=clip(MAX_NORM, calls=calls),
    )


def test_one_clip_call_per_parameter_group_is_named_with_each_calls_coefficient(tmp_path):
    report = check(_two_calls(tmp_path, {"a": 0.6, "b": 1.0}, {"a": 1.0, "b": 0.9}))
    found = {f.params: f for f in report.findings if f.code == "GA304"}
    assert set(found) == {("a",), ("b",)}
    assert math.isclose(found[("a",)].evidence["clip_coef"], 0.6, rel_tol=1e-9)
    assert found[("a",)].evidence["clip_calls"] == "1" and found[("b",)].evidence["clip_calls"] == "2"
    assert all(f.evidence["cause"] == "per_call" for f in found.values())
    true_norm = math.sqrt(2.5)  # of the gradient before the first call
    assert math.isclose(
        found[("b",)].evidence["expected_clip_coef"], MAX_NORM / (true_norm + 1e-6), rel_tol=1e-9
    )
    assert "GA301" not in codes(report)
    assert found[("a",)].fix.startswith("Clip once per step, with the norm of every param group together")
    assert "one call per param group, see GA304" in finding(report, "GA501").message  # not "each microbatch"


def test_the_norm_of_one_clip_call_per_parameter_group_is_named_as_groups_clipped_separately(tmp_path):
    """The first call clips b by b's norm (sqrt(0.5): below max_norm), the second a by a's (sqrt(2)):
    the second call's norm is what the true norm leaves once the first's is taken out (GA210)."""
    b_norm, a_norm = math.sqrt(0.5), math.sqrt(2.0)
    after = {"a": MAX_NORM / (a_norm + 1e-6), "b": 1.0}
    report = check(_two_calls(tmp_path, {"a": 1.0, "b": 1.0}, after, reported=(b_norm, a_norm)))
    assert "GA204" not in codes(report)
    found = finding(report, "GA210")
    assert found.evidence["cause"] == "per_call" and found.evidence["num_clip_calls"] == 2
    assert math.isclose(found.evidence["matched_norm"], a_norm, rel_tol=1e-9)
    assert found.fix.startswith("Clip once per step")
    assert {row.diagnosis for row in report.ranks} == {"per_param_group"}


def test_two_clip_calls_whose_norms_do_not_add_up_to_the_true_norm_are_not_named_per_group(tmp_path):
    report = check(_two_calls(tmp_path, {"a": 0.6, "b": 1.0}, {"a": 1.0, "b": 0.9}))
    assert "GA210" not in codes(report)


def test_gradients_that_grew_between_two_calls_are_judged_by_the_last_calls_coefficients(tmp_path):
    """Accumulation between the calls: no coefficient spans them; the last call scaled all alike."""
    report = check(_two_calls(tmp_path, {"a": 0.6, "b": 0.6}, {"a": 0.9, "b": 0.9}, grown=1.5))
    assert "GA304" not in codes(report) and "GA304" not in not_checked(report)
