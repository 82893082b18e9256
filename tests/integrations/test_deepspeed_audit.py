"""DeepSpeed ZeRO 1-3 on 2 gloo ranks (CPU): the partitions reassemble to the single-process gradients."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from deepspeed_workers import deepspeed_hand_clipping_and_accumulation, deepspeed_runs
from launcher import run_ranks
from models import reference_grads_tiny
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("deepspeed")
    return out_root, run_ranks(deepspeed_runs, 2, (str(out_root),), timeout_s=400)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_partitions_reassemble_to_the_reference_and_audit_clean(runs, stage):
    out_root, results = runs
    name = f"zero{stage}_ok"
    assert [len(r[name]["paths"]) for r in results] == [1, 1]
    step_path = out_root / name / "step_1"
    step = load(step_path)
    grads = reassemble(step, "grad")
    reference = reference_grads_tiny()
    assert sorted(grads) == sorted(reference)
    for param, expected in reference.items():
        assert float((grads[param] - expected.double()).abs().max()) < 1e-5, param
    assert step.clip.reported_norm == pytest.approx(norm_of(grads), rel=1e-5)
    assert error_codes(audit_report(step_path)) == set()
    assert {step.ranks[r].capture_api for r in step.ranks_present} == {"DeepSpeedAudit"}


@pytest.fixture(scope="module")
def by_hand(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("deepspeed_by_hand")
    return out_root, run_ranks(deepspeed_hand_clipping_and_accumulation, 2, (str(out_root),), timeout_s=400)


def test_zero3_clipped_by_hand_with_each_ranks_local_norm_is_diagnosed_as_a_local_norm(by_hand):
    out_root, results = by_hand
    assert [len(r["zero3_local_norm"]["paths"]) for r in results] == [1, 1]
    step_path = out_root / "zero3_local_norm" / "step_1"
    step = load(step_path)
    grads = reassemble(step, "grad")
    for param, expected in reference_grads_tiny().items():
        assert float((grads[param] - expected.double()).abs().max()) < 1e-5, param
    local_norms = [r["zero3_local_norm"]["norm"] for r in results]
    assert max(local_norms) < norm_of(grads) - 1e-3  # the mistake is real: each rank saw less
    codes = error_codes(audit_report(step_path))
    assert "GA201" in codes, codes


def test_zero3_clipped_by_hand_with_the_reduced_norm_audits_clean(by_hand):
    out_root, results = by_hand
    step_path = out_root / "zero3_reduced_norm" / "step_1"
    grads = reassemble(load(step_path), "grad")
    assert results[0]["zero3_reduced_norm"]["norm"] == pytest.approx(norm_of(grads), rel=1e-5)
    assert error_codes(audit_report(step_path)) == set()


def test_zero2_with_two_accumulation_micro_batches_is_audited_once_on_the_accumulated_gradients(by_hand):
    out_root, results = by_hand
    assert [len(r["zero2_accumulation"]["paths"]) for r in results] == [1, 1]
    step_path = out_root / "zero2_accumulation" / "step_1"
    step = load(step_path)
    grads = reassemble(step, "grad")
    for param, expected in reference_grads_tiny().items():
        assert float((grads[param] - expected.double()).abs().max()) < 1e-5, param
    assert step.clip.reported_norm == pytest.approx(norm_of(grads), rel=1e-5)
    assert error_codes(audit_report(step_path)) == set()
