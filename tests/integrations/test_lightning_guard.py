"""The guard as one Lightning callback on 2 gloo ranks: Lightning's own clip passes every step, and a
user's own clip in `on_after_backward` (each micro-batch) is GA501 from the first step."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from launcher import run_ranks
from lightning_guard_workers import NUM_STEPS, guarded_fit

pytestmark = pytest.mark.integration


def test_a_clip_per_micro_batch_in_a_hook_is_caught_and_lightnings_own_clip_passes(tmp_path):
    results = run_ranks(guarded_fit, 2, (str(tmp_path),), timeout_s=300)
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
        assert [step for step, _ in result["hook_clip"]["anomalies"]][:1] == [1]
        assert all("GA501" in codes for _, codes in result["hook_clip"]["anomalies"])
    # the true norm is logged beside Lightning's own metrics, and matches what the clip reported
    logged = results[0]["ok"]["logged"]
    assert logged["gradaudit/true_norm"] > 0
    assert logged["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
    trend = (tmp_path / "ok" / "guard_trend.jsonl").read_text().splitlines()
    assert len(trend) == NUM_STEPS
