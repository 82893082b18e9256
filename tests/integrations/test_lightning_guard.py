"""The guard as one Lightning callback on 2 gloo ranks: Lightning's own clip passes every step, and a
user's own clip in `on_after_backward` (each micro-batch) is GA501 from the first step; the same in
16-mixed with a GradScaler, where the hook's clip is also GA502."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from guard_workers import with_trends
from launcher import run_ranks
from lightning_guard_workers import LATE_LOG_EVERY, NUM_STEPS, guarded_fit
from reassemble import audit_report, error_codes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("lightning_guard")
    return out_root, with_trends(run_ranks(guarded_fit, 2, (str(out_root),), timeout_s=300), str(out_root))


def test_a_clip_per_micro_batch_in_a_hook_is_caught_and_lightnings_own_clip_passes(runs):
    tmp_path, results = runs
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
        assert [step for step, _ in result["hook_clip"]["anomalies"]][:1] == [1]
        assert all("GA501" in codes for _, codes in result["hook_clip"]["anomalies"])
    # the guard's dump of step 1: `gradaudit check` gives the code the guard named
    (codes,) = {tuple(codes) for step, codes in results[0]["hook_clip"]["anomalies"] if step == 1}
    assert error_codes(audit_report(tmp_path / "hook_clip" / "step_1")) == set(codes)
    # the true norm is logged beside Lightning's own metrics, and matches what the clip reported
    logged = results[0]["ok"]["logged"]
    assert logged["gradaudit/true_norm"] > 0
    assert logged["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
    trend = (tmp_path / "ok" / "guard_trend.jsonl").read_text().splitlines()
    assert len(trend) == NUM_STEPS


def test_16_mixed_with_its_grad_scaler_passes_lightnings_clip_and_catches_a_hooks_clip_of_scaled_gradients(
    runs,
):
    """Lightning's own 16-mixed plugin with a CPU GradScaler (precision="16-mixed" is bf16 on CPU)."""
    _, results = runs
    for result in results:
        ok, wrong = result["fp16_ok"], result["fp16_hook_clip"]
        assert ok["scaler"] and ok["anomalies"] == [] and ok["warnings"] == []
        # the default scale 2**16 overflows the first step: the scaler skips it, the guard writes it so
        assert [line["verdict"] for line in ok["trend"]] == ["skipped", "ok", "ok"]
        assert ok["logged"]["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
        # the hook clips each micro-batch before Lightning unscales: from the first step not skipped
        assert wrong["anomalies"] == [(2, ["GA501", "GA502"])]
        assert [line["verdict"] for line in wrong["trend"]] == ["skipped", "anomaly"]


def test_read_one_step_late_as_on_gpu_each_step_logged_carries_its_own_true_norm(runs):
    _, results = runs
    late = results[0]["late"]
    assert late["anomalies"] == [] and late["warnings"] == []
    trend = {line["step"]: line["true_norm"] for line in late["trend"]}
    assert sorted(trend) == list(range(1, NUM_STEPS + 1))
    # Lightning logs step 2 (log_every_n_steps=2): its own number, read at that log step, not step 1's
    assert [values["gradaudit/true_norm"] for values in late["logger"]] == [
        pytest.approx(trend[LATE_LOG_EVERY], rel=1e-6)
    ]
