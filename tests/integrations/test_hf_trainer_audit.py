"""HF Trainer with DDP on 2 gloo ranks: GradAuditCallback audits a step before the Trainer clips."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_workers import hf_trainer_fp16_run, hf_trainer_runs
from launcher import run_ranks
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory, monkeypatch_module):
    out_root = tmp_path_factory.mktemp("hf")
    return out_root, run_ranks(hf_trainer_runs, 2, (str(out_root),), timeout_s=300)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield mp


def test_the_callback_audits_a_correct_ddp_step_clean_with_the_norm_the_trainer_logged(runs):
    out_root, results = runs
    assert [len(r["hf_ddp_ok"]) for r in results] == [1, 1]
    step_path = out_root / "hf_ddp_ok" / "step_2"
    assert error_codes(audit_report(step_path)) == set()
    step = load(step_path)
    (call,) = step.clip.calls
    assert call.reported_norm == pytest.approx(norm_of(reassemble(step, "grad")), rel=1e-5)
    assert step.clip.reported_norm == call.reported_norm
    assert step.clip.clip_coef == pytest.approx(min(1.0, step.clip.max_norm / (call.reported_norm + 1e-6)))
    # 2 micro-batches of 2 sequences of 8 tokens per rank
    assert all(d.data.tokens == 32 and d.data.loss is not None for d in step.ranks.values())
    pieces = [p for d in step.ranks.values() for p in d.pieces]
    assert all(p.has("grad_clipped") and p.has("param_before") and p.has("param_after") for p in pieces)


def test_a_dump_from_on_pre_optimizer_step_after_the_trainer_clipped_is_named_ga503(runs):
    out_root, _ = runs
    report = audit_report(out_root / "hf_dump_after_clip" / "step_2")
    assert "GA503" in error_codes(report)


@pytest.mark.parametrize("scenario", ["hf_clip_per_micro_batch", "hf_accelerator_clip_per_micro_batch"])
def test_a_clip_per_micro_batch_in_a_training_step_override_is_named_ga501(runs, scenario):
    out_root, _ = runs
    step_path = out_root / scenario / "step_2"
    report = audit_report(step_path)
    assert "GA501" in error_codes(report) and "GA501" in report.verdict
    assert [len(d.clip.calls) for d in load(step_path).ranks.values()] == [
        3,
        3,
    ]  # 2 micro-batches + the Trainer's


def test_stats_mode_every_second_step_audits_clean_with_the_same_norm(runs):
    out_root, results = runs
    assert [len(r["hf_ddp_stats"]) for r in results] == [1, 1]
    step = load(out_root / "hf_ddp_stats" / "step_2")
    assert all(d.mode == "stats" for d in step.ranks.values())
    full = load(out_root / "hf_ddp_ok" / "step_2")
    assert step.clip.reported_norm == pytest.approx(full.clip.reported_norm, rel=1e-6)
    assert error_codes(audit_report(out_root / "hf_ddp_stats" / "step_2")) == set()


def test_with_fp16_and_a_grad_scaler_the_callback_records_unscaled_gradients_and_audits_clean(
    tmp_path, monkeypatch_module
):
    results = run_ranks(hf_trainer_fp16_run, 2, (str(tmp_path),), timeout_s=300)
    assert [len(paths) for paths in results] == [1, 1]
    step_path = tmp_path / "hf_fp16" / "step_2"
    step = load(step_path)
    assert all(d.clip.loss_scale is not None and d.clip.unscaled_before_clip for d in step.ranks.values())
    (call,) = step.clip.calls
    assert call.reported_norm == pytest.approx(norm_of(reassemble(step, "grad")), rel=1e-4)
    assert error_codes(audit_report(step_path)) == set()
