"""The guard as one HF Trainer callback on 2 gloo ranks: the Trainer's own clip passes every step,
and a `training_step` override clipping each micro-batch is GA501 from the first step; the true norm
logged is always the step's own."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_guard_workers import FP16_STEPS, guarded_train
from launcher import run_ranks
from reassemble import audit_report, error_codes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("hf_guard")
    return out_root, run_ranks(guarded_train, 2, (str(out_root),), timeout_s=300)


def test_a_clip_per_micro_batch_in_training_step_is_caught_and_the_trainers_own_clip_passes(runs):
    tmp_path, results = runs
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
        assert [step for step, _ in result["step_clip"]["anomalies"]][:1] == [1]
        assert all("GA501" in codes for _, codes in result["step_clip"]["anomalies"])
    # the guard's dump of step 1: `gradaudit check` gives the code the guard named
    (codes,) = {tuple(codes) for step, codes in results[0]["step_clip"]["anomalies"] if step == 1}
    assert error_codes(audit_report(tmp_path / "step_clip" / "step_1")) == set(codes)
    # the true norm is in each of the Trainer's log calls beside its grad_norm, for a reporting
    # callback registered before the guard's too, and in state.log_history
    for logs in (results[0]["ok"]["reported"], results[0]["ok"]["history"]):
        assert len(logs) == 2
        for log in logs:
            assert log["gradaudit_true_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
            assert log["gradaudit_reported_over_true"] == pytest.approx(1.0, rel=1e-5)
    # step 2 is captured in full after step 1's anomaly, not checked: its log has no true norm, not
    # step 1's again
    history = results[0]["step_clip"]["history"]
    assert [log["step"] for log in history] == [1, 2]
    assert "gradaudit_true_norm" in history[0] and "gradaudit_true_norm" not in history[1]
    assert [("gradaudit_true_norm" in log) for log in results[0]["step_clip"]["reported"]] == [True, False]


def test_fp16_with_accelerates_grad_scaler_passes_the_trainers_clip_and_catches_a_clip_of_scaled_gradients(
    runs,
):
    """Accelerate makes no GradScaler on CPU: the one it makes on GPU is installed on the Trainer's
    Accelerator before train(); the scaling, the unscale inside its clip and the step are its own."""
    _, results = runs
    for result in results:
        ok, wrong = result["fp16_ok"], result["fp16_step_clip"]
        assert ok["scaler"] and ok["anomalies"] == [] and ok["warnings"] == []
        # a clip in training_step sees the gradients still multiplied by the loss scale
        assert wrong["anomalies"][:1] == [(1, ["GA501", "GA502"])]
    history = results[0]["fp16_ok"]["history"]
    assert [log["step"] for log in history] == list(range(1, FP16_STEPS + 1))
    for log in history:
        assert log["gradaudit_true_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
    step_1 = results[0]["fp16_step_clip"]["history"][0]
    # the ratio is of the grad_norm logged beside it: the Trainer's own clip, after the override clipped
    # gradients still multiplied by the loss scale (GradScaler("cpu")'s initial 2**16) to max_norm, so far
    # below the true norm
    assert step_1["gradaudit_reported_over_true"] == pytest.approx(
        step_1["grad_norm"] / step_1["gradaudit_true_norm"], rel=1e-5
    )
    assert step_1["gradaudit_reported_over_true"] < 1e-2
