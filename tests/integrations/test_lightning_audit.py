"""Lightning on 2 gloo ranks: the callback audits DDP and FSDP2 (ModelParallelStrategy) steps."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from launcher import run_ranks
from lightning_workers import lightning_runs
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("lightning")
    return out_root, run_ranks(lightning_runs, 2, (str(out_root),), timeout_s=300)


@pytest.mark.parametrize(
    "scenario", ["lightning_ddp_ok", "lightning_ddp_accumulate_ok", "lightning_fsdp2_ok"]
)
def test_lightnings_own_norm_clipping_audits_clean_with_the_norm_it_clipped_with(runs, scenario):
    out_root, results = runs
    assert [len(r[scenario]) for r in results] == [1, 1]
    step_path = out_root / scenario / "step_2"
    assert error_codes(audit_report(step_path)) == set()
    step = load(step_path)
    assert len(step.clip.calls) == 1
    assert step.clip.reported_norm == pytest.approx(norm_of(reassemble(step, "grad")), rel=1e-5)
    if scenario == "lightning_ddp_accumulate_ok":  # 2 micro-batches of half the rows: the same gradient
        assert step.clip.reported_norm == pytest.approx(
            load(out_root / "lightning_ddp_ok" / "step_2").clip.reported_norm, rel=1e-5
        )
    pieces = [p for d in step.ranks.values() for p in d.pieces]
    assert all(p.has("grad_clipped") and p.has("param_before") and p.has("param_after") for p in pieces)


def test_a_local_norm_clip_in_configure_gradient_clipping_under_fsdp2_is_named_ga201(runs):
    out_root, _ = runs
    assert "GA201" in error_codes(audit_report(out_root / "lightning_fsdp2_local_clip" / "step_2"))


def test_a_clip_per_micro_batch_in_on_after_backward_is_named_ga501(runs):
    out_root, _ = runs
    step_path = out_root / "lightning_ddp_accumulate_hook_clip" / "step_2"
    report = audit_report(step_path)
    assert "GA501" in error_codes(report) and "GA501" in report.verdict
    assert [len(d.clip.calls) for d in load(step_path).ranks.values()] == [
        3,
        3,
    ]  # 2 micro-batches + Lightning's
