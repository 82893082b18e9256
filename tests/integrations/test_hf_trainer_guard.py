"""The guard as one HF Trainer callback on 2 gloo ranks: the Trainer's own clip passes every step,
and a `training_step` override clipping each micro-batch is GA501 from the first step; what is logged,
read back from state.log_history and a reporting callback: each logged step's own values at its step,
an anomaly at its step whatever logging_steps, nothing for the step captured in full. The guard's
spike= through the callback's keywords, and its replica check of DDP's reduced gradients (GA601)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from guard_spike_replica import SPIKE_STEP, assert_one_spike, assert_replica_fault
from guard_workers import with_trends
from hf_guard_workers import FP16_STEPS, STEP_CLIP_STEPS, guarded_train
from launcher import run_ranks
from reassemble import audit_report, error_codes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("hf_guard")
    return out_root, with_trends(run_ranks(guarded_train, 2, (str(out_root),), timeout_s=300), str(out_root))


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
    trend = {line["step"]: line for line in results[0]["ok"]["trend"]}
    for logs in (results[0]["ok"]["reported"], results[0]["ok"]["history"]):
        assert len(logs) == 2
        for log, step in zip(logs, (1, 2), strict=True):
            assert log.get("step", log.get("at_step")) == step
            assert log["gradaudit_true_norm"] == pytest.approx(trend[step]["true_norm"], rel=1e-9)
            assert log["gradaudit_true_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
            assert log["gradaudit_reported_over_true"] == pytest.approx(1.0, rel=1e-5)
            assert log["gradaudit_anomaly"] == 0.0
    assert results[0]["ok"]["history_alone"] == [] and results[0]["ok"]["reported_alone"] == []


def test_each_anomaly_is_logged_at_its_step_between_logging_steps_and_the_step_captured_in_full_logs_nothing(
    runs,
):
    """The override clips each micro-batch on every step; the Trainer logs steps 2 and 4. Step 1's anomaly
    is dumped, step 2 captured in full (not checked), steps 3 and 4 checked again (anomalies, not dumped
    within the cooldown)."""
    _, results = runs
    run = results[0]["step_clip"]
    trend = {line["step"]: line for line in run["trend"]}
    assert sorted(trend) == [1, 3, 4] and all(trend[s]["codes"] for s in trend)
    # the Trainer's own log calls: step 2 (captured in full) has no gradaudit value, not step 1's again
    history = run["history"]
    assert [log["step"] for log in history] == [2, STEP_CLIP_STEPS]
    assert not any(key.startswith("gradaudit_") for key in history[0])
    # steps 1 and 3, which the Trainer does not log, are logged alone, at their own step
    alone = run["history_alone"]
    assert [log["step"] for log in alone] == [1, 3]
    assert [log["at_step"] for log in run["reported_alone"]] == [1, 3]  # the reporting callback's too
    for log in (*alone, history[1]):
        line = trend[log["step"]]
        assert log["gradaudit_anomaly"] == len(line["codes"]) >= 1
        assert log["gradaudit_true_norm"] == pytest.approx(line["true_norm"], rel=1e-9)
        # the first clip call reports the true norm (ratio 1); the last, the Trainer's, reports the norm
        # of a gradient the micro-batch clips shrank: far from it
        assert line["reported_norm"] == pytest.approx(line["true_norm"], rel=1e-5)
        assert log["gradaudit_reported_over_true"] < 0.9
    # beside a grad_norm (the Trainer's clip, the step's last call), the ratio is of that grad_norm
    assert history[1]["gradaudit_reported_over_true"] == pytest.approx(
        history[1]["grad_norm"] / history[1]["gradaudit_true_norm"], rel=1e-6
    )


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


def test_a_spike_passed_through_the_callback_is_marked_named_by_its_parameters_and_dumped(runs, cli):
    """One step's loss scaled by 100; its shares are those of the gradients DDP reduced."""
    out_root, results = runs
    spike = [result["spike"] for result in results]
    assert_one_spike(spike, spike[0]["sums"], out_root / "spike" / f"step_{SPIKE_STEP}", cli)


def test_a_flipped_bit_in_one_ranks_reduced_gradient_is_ga601_at_its_step(runs):
    _, results = runs
    assert_replica_fault([result["replica_flip"] for result in results], (0, 1))
