"""The guard as one HF Trainer callback on 2 gloo ranks: the Trainer's own clip passes every step,
and a `training_step` override clipping each micro-batch is GA501 from the first step; the true norm
logged is always the step's own."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_guard_workers import guarded_train
from launcher import run_ranks

pytestmark = pytest.mark.integration


def test_a_clip_per_micro_batch_in_training_step_is_caught_and_the_trainers_own_clip_passes(tmp_path):
    results = run_ranks(guarded_train, 2, (str(tmp_path),), timeout_s=300)
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
        assert [step for step, _ in result["step_clip"]["anomalies"]][:1] == [1]
        assert all("GA501" in codes for _, codes in result["step_clip"]["anomalies"])
    assert (tmp_path / "step_clip" / "step_1").is_dir()
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
