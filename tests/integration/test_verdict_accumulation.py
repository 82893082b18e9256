"""Gradient accumulation with a clip after every micro-batch, on real gloo ranks: GA501 leads the
verdict, every norm says which moment it is of, and nothing is derived across moments."""

from __future__ import annotations

import pytest
import verdict_workers
from launcher import run_ranks
from models import reference_grads_tiny
from reassemble import norm_of

from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions

pytestmark = pytest.mark.integration

WORLD_SIZE = 2


def _audit(worker, tmp_path):
    (step_dir, _) = run_ranks(worker, WORLD_SIZE, (str(tmp_path),), timeout_s=180)
    return audit_step_dir(step_dir, AuditOptions())


def test_fsdp2_accumulation_with_a_clip_per_microbatch_is_diagnosed_as_clipping_twice(tmp_path):
    report = _audit(verdict_workers.fsdp2_accumulation_clip_per_microbatch, tmp_path)
    codes = {f.code for f in report.findings if f.severity.value != "info"}
    assert codes == {"GA501"}, [(f.code, f.message) for f in report.findings]
    assert report.verdict.split(". ")[1].startswith("GA501")
    true_norm = norm_of(reference_grads_tiny())
    assert report.global_norm == pytest.approx(true_norm, rel=1e-5)
    assert "before the last of 2 clip calls" in report.verdict
    (ga501,) = [f for f in report.findings if f.code == "GA501"]
    assert ga501.evidence["call_1_true_norm"] == 0.0
    assert ga501.evidence["call_2_true_norm"] == pytest.approx(true_norm, rel=1e-5)
    assert {row.diagnosis for row in report.ranks} == {"correct"}


def test_ddp_accumulation_with_no_sync_and_a_clip_per_microbatch_gives_no_replica_or_coefficient_finding(
    tmp_path,
):
    report = _audit(verdict_workers.ddp_accumulation_clip_per_microbatch, tmp_path)
    codes = {f.code for f in report.findings if f.severity.value != "info"}
    assert "GA501" in codes and not codes & {"GA601", "GA301", "GA302"}, [
        (f.code, f.message) for f in report.findings
    ]
    assert report.verdict.split(". ")[1].startswith("GA501")
    (ga501,) = [f for f in report.findings if f.code == "GA501"]
    assert "replicas not yet reduced" in ga501.message
    assert ga501.evidence["call_2_true_norm"] == pytest.approx(report.global_norm, rel=1e-9)
