"""FSDP2, HSDP, tensor parallel and FSDP2 over TP on 4 gloo ranks: the dumps reassemble to the
single-process gradients, their norm is the one the stack returned, and mistakes are diagnosed."""

from __future__ import annotations

import math

import pytest
import scenarios_dtensor
from launcher import run_ranks
from models import reference_grads_tied, reference_grads_tiny, write_reference_dump
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration

WORLD_SIZE = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("dtensor_stacks")
    results = run_ranks(scenarios_dtensor.all_dtensor_stacks, WORLD_SIZE, (str(out_root),), timeout_s=240)
    return out_root, results


@pytest.fixture(scope="module")
def references():
    return {"tiny": reference_grads_tiny(), "tied": reference_grads_tied()}


@pytest.fixture(scope="module")
def reference(references):
    return references["tiny"]


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory):
    return write_reference_dump(tmp_path_factory.mktemp("single_process"))


def _step(runs, scenario):
    out_root, results = runs
    return out_root / scenario / "step_1", [r[scenario] for r in results]


def _assert_reassembles_to_reference(step_path, reference):
    step = load(step_path)
    assert step.missing_ranks == ()
    grads = reassemble(step, "grad")
    assert sorted(grads) == sorted(reference)
    for name, expected in reference.items():
        assert grads[name].shape == expected.shape, name
        assert float((grads[name] - expected.double()).abs().max()) < 1e-5, name
    return step, grads


@pytest.mark.parametrize("scenario", ["fsdp2_ok", "hsdp_ok", "tp_ok", "fsdp2_tp_ok", "pp_fsdp2_ok"])
def test_correct_clipping_dump_reassembles_and_recomputes_the_returned_norm(
    runs, references, reference_dump, scenario
):
    pipeline = scenario.startswith("pp_")  # TiedNet in two stages; the others run TinyNet
    step_path, per_rank = _step(runs, scenario)
    step, grads = _assert_reassembles_to_reference(step_path, references["tied" if pipeline else "tiny"])
    true_norm = norm_of(grads)
    for result in per_rank:
        assert math.isclose(true_norm, result["returned_norm"], rel_tol=1e-5)
    clipped = reassemble(step, "grad_clipped")
    assert math.isclose(norm_of(clipped), 0.1, rel_tol=1e-4)  # every correct run clips to max_norm
    report = audit_report(step_path, reference=None if pipeline else reference_dump)
    if report is not None:
        assert math.isclose(report.global_norm, true_norm, rel_tol=1e-9)
        assert error_codes(report) == set()
        if not pipeline:  # GA602/GA603 compared every parameter with the single-process dump
            assert {c.param for c in report.reference} == set(references["tiny"])


def test_fsdp2_shards_are_uneven_and_one_rank_holds_no_head_rows(runs):
    step = load(_step(runs, "fsdp2_ok")[0])
    head_rows = {
        rank: sum(p.local_shape[0] for p in dump.pieces if p.param == "head.weight")
        for rank, dump in step.ranks.items()
    }
    assert head_rows == {0: 1, 1: 1, 2: 1, 3: 0}
    assert step.topology.mesh.axis_names == ("dp_shard",)
    assert step.topology.norm_group == "dp_shard"  # clip_grad_norm_ returned a DTensor on that mesh


def test_hsdp_pieces_are_replicas_over_the_replicate_axis(runs):
    step = load(_step(runs, "hsdp_ok")[0])
    groups = {p.replica_group for dump in step.ranks.values() for p in dump.pieces}
    assert groups == {"dp_replicate"}
    assert step.topology.groups["dp_replicate"] == ((0, 2), (1, 3))
    assert step.topology.groups["dp_shard"] == ((0, 1), (2, 3))
    calls = [d.clip.calls[0] for d in step.ranks.values()]
    # a DTensor norm is recorded as its full value, and as the local value a careless .item() logs
    assert len({c.reported_norm for c in calls}) == 1
    assert all(
        c.reported_local_norm is not None and c.reported_local_norm <= c.reported_norm * (1 + 1e-6)
        for c in calls
    )


def test_tensor_parallel_layernorm_beside_dtensors_is_a_replica_over_tp(runs):
    step = load(_step(runs, "tp_ok")[0])
    for dump in step.ranks.values():
        pieces = {p.param: p for p in dump.pieces}
        assert pieces["norm.weight"].replica_group == "tp"
        assert pieces["fc1.weight"].regions[0].shape == (4, 8)  # column-parallel: a quarter of the rows
        assert pieces["fc2.weight"].regions[0].shape == (8, 4)  # row-parallel: a quarter of the columns


def test_fsdp2_over_tp_maps_strided_shards_to_the_right_rows(runs):
    step = load(_step(runs, "fsdp2_tp_ok")[0])
    fc1_rows = {
        rank: [p.regions[0].offsets[0] for p in d.pieces if p.param == "fc1.weight"]
        for rank, d in step.ranks.items()
    }
    # TP chunk t holds rows [8t, 8t+8); FSDP over dp splits it again: rank (dp=d, tp=t) starts at 8t + 4d.
    assert fc1_rows == {0: [0], 1: [8], 2: [4], 3: [12]}
    assert step.topology.mesh.axis_names == ("dp", "tp")


def test_stats_mode_under_fsdp2_keeps_values_only_for_the_chosen_params(runs, reference):
    step_path, per_rank = _step(runs, "fsdp2_stats")
    step = load(step_path)
    assert {d.mode for d in step.ranks.values()} == {"stats"}
    sum_sq = 0.0
    for dump in step.ranks.values():
        for piece in dump.pieces:
            assert set(piece.tensors) == (
                {"grad", "grad_clipped", "param_before", "param_after"}
                if piece.param.startswith("fc1.")
                else set()
            )
            sum_sq += piece.stats["grad"].sum_sq
    true_norm = norm_of({k: v.double() for k, v in reference.items()})
    assert math.isclose(math.sqrt(sum_sq), true_norm, rel_tol=1e-6)  # FSDP2 pieces are disjoint: no replicas
    assert all(math.isclose(r["returned_norm"], true_norm, rel_tol=1e-5) for r in per_rank)
    report = audit_report(step_path)
    if report is not None:
        assert math.isclose(report.global_norm, true_norm, rel_tol=1e-6)
        assert error_codes(report) == set()


def test_pipeline_stages_hold_only_their_parameters_and_the_tied_weight_under_its_logical_name(runs):
    step = load(_step(runs, "pp_fsdp2_ok")[0])
    held = {rank: sorted({p.param for p in d.pieces}) for rank, d in step.ranks.items()}
    assert held[0] == held[1] == ["embed.weight", "fc.bias", "fc.weight"]
    assert held[2] == held[3] == ["embed.weight", "norm.bias", "norm.weight"]
    tied = [p for p in step.ranks[2].pieces if p.param == "embed.weight"]
    assert tied[0].local_name == "lm_head.weight"
    # stages are not replicas of each other along the pipeline axis
    assert all(p.replica_group is None for d in step.ranks.values() for p in d.pieces)


@pytest.mark.parametrize(
    "scenario, code",
    [
        ("fsdp2_local", "GA201"),
        ("hsdp_world", "GA202"),
        ("tp_replicas", "GA202"),
        ("pp_fsdp2_stage_only", "GA203"),
        ("pp_fsdp2_dp_reduced", "GA203"),
    ],
)
def test_deliberate_mistake_is_diagnosed(runs, references, scenario, code):
    step_path, per_rank = _step(runs, scenario)
    _, grads = _assert_reassembles_to_reference(
        step_path, references["tied" if scenario.startswith("pp_") else "tiny"]
    )
    true_norm = norm_of(grads)
    reported = [r["returned_norm"] for r in per_rank]
    assert all(not math.isclose(n, true_norm, rel_tol=1e-3) for n in reported)
    report = audit_report(step_path)
    if report is None:
        pytest.skip("gradaudit.audit is not there yet; the dump itself was verified above")
    assert code in error_codes(report)
    assert "GA204" not in error_codes(report)  # a known mistake, not an unexplained norm


def test_stage_norms_all_reduced_over_the_data_parallel_group_name_that_group_not_double_counting(runs):
    """Each stage's norm (complete over its FSDP2 group) all-reduced over the
    data-parallel group instead of the pipeline group was GA202, every copy counted; it is a norm
    reduced over the wrong group, and the finding names the group it was reduced over."""
    step_path, per_rank = _step(runs, "pp_fsdp2_dp_reduced")
    stage_norms = [r["returned_norm"] for r in _step(runs, "pp_fsdp2_stage_only")[1]]
    assert all(
        math.isclose(r["returned_norm"], math.sqrt(2) * s, rel_tol=1e-5)
        for r, s in zip(per_rank, stage_norms, strict=True)
    )
    report = audit_report(step_path)
    assert "GA203" in error_codes(report) and not error_codes(report) & {"GA202", "GA204"}
    [found] = [f for f in report.findings if f.code == "GA203"]
    assert found.evidence["group"] == "dp_shard" and found.ranks == (0, 1, 2, 3)
    assert "over process group 'dp_shard'" in found.message and "summed over the group again" in found.message
    assert math.isclose(found.evidence["matched_norm"], per_rank[0]["returned_norm"], rel_tol=1e-5)
    assert {row.diagnosis for row in report.ranks} == {"wrong_group:dp_shard"}


@pytest.mark.parametrize("scenario, exit_code", [("hsdp_ok", 0), ("hsdp_world", 1)])
def test_gradaudit_check_on_the_captured_folder_exits_by_its_findings(runs, scenario, exit_code):
    import json
    import subprocess
    import sys

    step_path, _ = _step(runs, scenario)
    if audit_report(step_path) is None:
        pytest.skip("the check command is not there yet")
    done = subprocess.run(
        [sys.executable, "-m", "gradaudit", "check", str(step_path), "--format", "json"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == exit_code, done.stderr
    codes = {f["code"] for f in json.loads(done.stdout)["findings"] if f["severity"] == "error"}
    if exit_code == 0:
        assert codes == set()
    else:
        assert "GA202" in codes
