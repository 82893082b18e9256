"""The guard in one line beside torchtitan's clip_grad_norm_ on 4 gloo ranks (2 pipeline stages x 2
FSDP2 ranks): the norm reduced over the pp mesh passes every step, and leaving the pp mesh out is
named at the step it happens, with the code `gradaudit check` gives for the guard's dump."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.distributed.utils")

from launcher import run_ranks
from reassemble import audit_report, error_codes
from torchtitan_guard_workers import MISTAKE_AT, NUM_STEPS, guarded_torchtitan

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("torchtitan_guard")
    return out_root, run_ranks(guarded_torchtitan, 4, (str(out_root),), timeout_s=300)


def test_torchtitans_clip_reduced_over_the_pp_mesh_is_never_flagged(runs):
    _, results = runs
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
        assert result["ok"]["true_norms"][0] == pytest.approx(result["ok"]["norms"][-1], rel=1e-5)
        # on_verdict= gets every checked step's line, on every rank: the values to log
        verdicts = result["ok"]["verdicts"]
        assert [step for step, _ in verdicts] == list(range(1, NUM_STEPS + 1))
        for (_, values), returned in zip(verdicts, result["ok"]["norms"], strict=True):
            assert values["gradaudit/true_norm"] == pytest.approx(returned, rel=1e-5)
            assert values["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)


def test_leaving_out_the_pp_mesh_is_named_at_its_step_with_the_code_check_gives(runs):
    out_root, results = runs
    for result in results:
        anomalies = result["stage_norm"]["anomalies"]
        assert [step for step, _ in anomalies][:1] == [MISTAKE_AT]
        assert "GA203" in anomalies[0][1]
    assert "GA203" in error_codes(audit_report(out_root / "stage_norm" / f"step_{MISTAKE_AT}"))
