"""Accelerate on 2 gloo ranks with gradient accumulation: AccelerateAudit audits one optimizer step."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from accelerate_workers import accelerate_runs
from launcher import run_ranks
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
