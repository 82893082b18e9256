"""The guard in one line under DeepSpeed ZeRO 1-3 on 2 gloo ranks: DeepSpeed's own clip passes every
step with the true norm equal to the one DeepSpeed clipped with, and a norm that is not reduced over
the data-parallel group is named at its step, with the code `gradaudit check` gives for the dump."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from deepspeed_guard_workers import MISTAKE_AT, NUM_STEPS, guarded_deepspeed
from launcher import run_ranks
from reassemble import audit_report, error_codes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("deepspeed_guard")
    return out_root, run_ranks(guarded_deepspeed, 2, (str(out_root),), timeout_s=300)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeeds_own_clip_is_never_flagged(runs, stage):
    _, results = runs
    for result in results:
        run = result[f"zero{stage}"]
        assert run["anomalies"] == [] and run["warnings"] == []
        assert run["last"]["step"] == NUM_STEPS
        assert run["last"]["true_norm"] == pytest.approx(run["norms"][-1], rel=1e-5)
        assert run["last"]["true_norm"] > 0.1  # DeepSpeed clipped


def test_a_norm_not_reduced_over_the_data_parallel_group_is_named_at_its_step(runs):
    out_root, results = runs
    for result in results:
        anomalies = result["zero2_local_norm"]["anomalies"]
        assert [step for step, _ in anomalies] == [MISTAKE_AT]
        assert "GA201" in anomalies[0][1]
    assert "GA201" in error_codes(audit_report(out_root / "zero2_local_norm" / f"step_{MISTAKE_AT}"))
