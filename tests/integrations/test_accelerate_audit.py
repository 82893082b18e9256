"""Accelerate on 2 gloo ranks with gradient accumulation: AccelerateAudit audits one optimizer step."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from accelerate_workers import accelerate_fp16_runs, accelerate_runs
from launcher import run_ranks
from models import reference_grads_tiny
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("accelerate")
    return out_root, run_ranks(accelerate_runs, 2, (str(out_root),), timeout_s=240)


def test_the_guarded_clip_audits_clean_and_the_dump_holds_the_norm_accelerate_returned(runs):
    out_root, results = runs
    step_path = out_root / "accelerate_ok" / "step_2"
    assert [len(r["accelerate_ok"]["paths"]) for r in results] == [1, 1]
    report = audit_report(step_path)
    assert error_codes(report) == set()
    step = load(step_path)
    assert len(step.clip.calls) == 1
    returned = results[0]["accelerate_ok"]["norms"][1]
    assert norm_of(reassemble(step, "grad")) == pytest.approx(returned, rel=1e-5)
    assert all(p.has("param_before") and p.has("param_after") for d in step.ranks.values() for p in d.pieces)


def test_clipping_every_micro_batch_without_the_sync_gradients_guard_is_named_ga501(runs):
    out_root, _ = runs
    step_path = out_root / "accelerate_clip_every_microbatch" / "step_2"
    step = load(step_path)
    assert all(len(d.clip.calls) == 2 for d in step.ranks.values())
    assert "GA501" in error_codes(audit_report(step_path))


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("accelerate_fp16")
    return out_root, run_ranks(accelerate_fp16_runs, 2, (str(out_root),), timeout_s=240)


def test_fp16_with_a_grad_scaler_records_the_unscaled_gradients_and_audits_clean(fp16_runs):
    out_root, results = fp16_runs
    step_path = out_root / "accelerate_fp16_ok" / "step_1"
    assert [len(r["accelerate_fp16_ok"]["paths"]) for r in results] == [1, 1]
    step = load(step_path)
    grads = reassemble(step, "grad")
    for param, expected in reference_grads_tiny().items():
        # fp16 autocast in the forward: close to the fp32 reference, and nowhere near 4096 times it
        assert float((grads[param] - expected.double()).abs().max()) < 2e-3, param
    assert norm_of(grads) == pytest.approx(results[0]["accelerate_fp16_ok"]["norm"], rel=1e-5)
    assert all(d.clip.loss_scale == 2.0**12 and d.clip.unscaled_before_clip for d in step.ranks.values())
    assert error_codes(audit_report(step_path)) == set()


def test_fp16_clipped_with_torch_clip_grad_norm_skipping_accelerates_unscale_is_named_ga502(fp16_runs):
    out_root, _ = fp16_runs
    step_path = out_root / "accelerate_fp16_torch_clip" / "step_1"
    step = load(step_path)
    assert all(d.clip.unscaled_before_clip is False for d in step.ranks.values())
    assert "GA502" in error_codes(audit_report(step_path))
