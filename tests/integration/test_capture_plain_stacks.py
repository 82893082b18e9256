"""DDP, pipeline stages with a tied embedding, and Megatron-style tensor parallel on 2 gloo ranks:
the dumps reassemble to the single-process gradients, and mistakes are diagnosed."""

from __future__ import annotations

import math

import pytest
import scenarios_plain
from launcher import run_ranks
from models import MAX_NORM, reference_grads_tied, reference_grads_tiny, write_reference_dump
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("plain_stacks")
    results = run_ranks(scenarios_plain.all_plain_stacks, WORLD_SIZE, (str(out_root),), timeout_s=180)
    return out_root, results


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory):
    return write_reference_dump(tmp_path_factory.mktemp("single_process"))


def _reference(scenario):
    return reference_grads_tied() if scenario.startswith("pp_") else reference_grads_tiny()


def _reassembled(runs, scenario):
    out_root, results = runs
    step_path = out_root / scenario / "step_1"
    step = load(step_path)
    assert step.missing_ranks == ()
    grads = {scenarios_plain.MEGATRON_NAMES.get(k, k): v for k, v in reassemble(step, "grad").items()}
    reference = _reference(scenario)
    scale = 1.0
    if scenario == "ddp_twice":  # the dump holds the gradient before the last clip call: after the first
        scale = min(1.0, MAX_NORM / (step.ranks[0].clip.calls[0].reported_norm + 1e-6))
    assert sorted(grads) == sorted(reference)
    for name, expected in reference.items():
        assert float((grads[name] - scale * expected.double()).abs().max()) < 1e-5, name
    return step_path, step, norm_of(grads), [r[scenario]["returned_norm"] for r in results]


@pytest.mark.parametrize("scenario", ["ddp_ok", "pp_ok", "megatron_ok"])
def test_correct_clipping_dump_reassembles_and_recomputes_the_returned_norm(runs, reference_dump, scenario):
    step_path, _, true_norm, returned = _reassembled(runs, scenario)
    assert all(math.isclose(true_norm, n, rel_tol=1e-5) for n in returned)
    same_names = scenario == "ddp_ok"  # the reference is TinyNet; the other stacks name things their own way
    report = audit_report(step_path, reference=reference_dump if same_names else None)
    if report is not None:
        assert math.isclose(report.global_norm, true_norm, rel_tol=1e-9)
        assert error_codes(report) == set()
        if same_names:
            assert len(report.reference) >= 8


def test_ddp_parameters_are_whole_replicas_over_the_world_without_the_module_prefix(runs):
    _, step, _, _ = _reassembled(runs, "ddp_ok")
    for dump in step.ranks.values():
        assert {p.param for p in dump.pieces} == {
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias",
            "norm.weight",
            "norm.bias",
            "head.weight",
            "head.bias",
        }
        assert {p.replica_group for p in dump.pieces} == {"world"}
    assert step.topology.groups["world"] == ((0, 1),)


def test_tied_embedding_on_the_last_stage_is_recorded_under_its_logical_name(runs):
    _, step, _, _ = _reassembled(runs, "pp_ok")
    first = {p.param for p in step.ranks[0].pieces}
    last = {p.param: p for p in step.ranks[1].pieces}
    assert first == {"embed.weight", "fc.weight", "fc.bias"}
    assert set(last) == {"embed.weight", "norm.weight", "norm.bias"}
    assert last["embed.weight"].local_name == "lm_head.weight"
    assert step.ranks[1].aliases == {"lm_head.weight": "embed.weight"}


def test_megatron_attributes_place_the_tensor_parallel_partitions(runs):
    _, step, _, _ = _reassembled(runs, "megatron_ok")
    offsets = {rank: {p.param: p.regions[0].offsets for p in d.pieces} for rank, d in step.ranks.items()}
    assert offsets[1]["fc1_weight"] == (8, 0) and offsets[1]["fc2_weight"] == (0, 8)
    replicas = {p.param: p.replica_group for p in step.ranks[0].pieces}
    assert replicas["fc1_weight"] is None and replicas["norm.weight"] == "tp"


@pytest.mark.parametrize(
    "scenario, code",
    [("ddp_twice", "GA501"), ("pp_stage_only", "GA201"), ("megatron_replicas", "GA202")],
)
def test_deliberate_mistake_is_diagnosed(runs, scenario, code):
    if scenario == "ddp_twice":
        # The dump holds the gradient before the last call; the first call saw the reference gradient.
        step_path = runs[0] / scenario / "step_1"
        step = load(step_path)
        assert len(step.ranks[0].clip.calls) == 2
        first = math.sqrt(sum(p.call_stats[0].sum_sq for p in step.ranks[0].pieces))
        assert math.isclose(first, norm_of(reference_grads_tiny()), rel_tol=1e-5)
    else:
        step_path, step, true_norm, returned = _reassembled(runs, scenario)
        assert all(not math.isclose(n, true_norm, rel_tol=1e-3) for n in returned)
    report = audit_report(step_path)
    if report is None:
        pytest.skip("gradaudit.audit is not there yet; the dump itself was verified above")
    assert code in error_codes(report)
