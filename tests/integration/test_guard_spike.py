"""spike=10.0 on real gloo ranks: one batch scaled by 100 makes a spike at its step; the guard marks it
in the trend, names the parameters holding most of its Σg², and the dump it writes shows those shares
in `gradaudit check`, matching the full gradients' own Σg² per parameter (replicas counted once)."""

from __future__ import annotations

import json

import pytest
import spike_workers as workers
from launcher import run_ranks

from gradaudit.live.spike import shares_text, top_shares
from gradaudit.live.trend import TREND_FILE, read_trend

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("stack", ["ddp", "fsdp2"])
def test_a_spike_is_marked_named_by_its_parameters_and_dumped(tmp_path, stack, cli):
    results = run_ranks(workers.train, 2, (str(tmp_path), stack), timeout_s=300)
    unsharded = results[0]["unsharded"]
    names = sorted(unsharded)
    expected = top_shares(names, [unsharded[n] for n in names])
    trend = read_trend(tmp_path / TREND_FILE).lines
    assert [line.step for line in trend if line.spike] == [workers.SPIKE_STEP]
    said = [w for w in results[0]["warnings"] if "a spike" in w]
    assert len(said) == 1 and said[0].startswith(
        f"gradaudit guard: step {workers.SPIKE_STEP}: a spike: true norm"
    )
    assert shares_text(expected) in said[0]
    for result in results:
        assert result["anomalies"] == []
    code, out, _ = cli("check", str(tmp_path / f"step_{workers.SPIKE_STEP}"), "--format", "json")
    report = json.loads(out)
    assert code == 0, report["findings"]
    shares = report["sum_sq_shares"]
    assert [entry["param"] for entry in shares["top"]][: len(expected)] == [name for name, _ in expected]
    for entry, (_, share) in zip(shares["top"], expected, strict=False):
        assert entry["share"] == pytest.approx(share, rel=1e-5)
