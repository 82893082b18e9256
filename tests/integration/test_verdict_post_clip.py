"""A real FSDP2 step dumped after clipping, with no norm recorded: the report must not read as a pass,
and names the capture point."""

from __future__ import annotations

import pytest
import verdict_workers
from launcher import run_ranks

from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions

pytestmark = pytest.mark.integration


def test_a_dump_taken_after_clipping_without_a_norm_says_clipping_not_checked(tmp_path):
    (step_dir, _) = run_ranks(verdict_workers.fsdp2_dump_after_clipping, 2, (str(tmp_path),), timeout_s=180)
    report = audit_step_dir(step_dir, AuditOptions())
    # The gradients' norm is max_norm itself: GA503 names the capture point, and it leads the verdict
    # over GA206's "clipping not checked" (both are true; the capture point is the actionable one).
    assert "GA503" in report.verdict, report.verdict
    assert "Clipping used the true global norm" not in report.verdict
    assert report.worst_severity is not None and report.worst_severity.value == "error"
    assert {"GA503", "GA206"} <= {f.code for f in report.findings}
