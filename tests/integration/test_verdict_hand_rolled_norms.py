"""Hand-rolled norms on 4 real FSDP2 gloo ranks: local norms averaged over the world (GA208), and a
float32 sum of squares that overflows on a finite 1e20 gradient (GA209), not "matches nothing"."""

from __future__ import annotations

import pytest
import verdict_workers
from launcher import run_ranks

from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions

pytestmark = pytest.mark.integration


def _report(tmp_path, mistake):
    (step_dir, *_) = run_ranks(
        verdict_workers.fsdp2_hand_rolled_norm, 4, (str(tmp_path), mistake), timeout_s=180
    )
    return audit_step_dir(step_dir, AuditOptions())


def _errors(report):
    return {f.code for f in report.findings if f.severity.value == "error"}


def test_local_norms_averaged_over_data_parallel_are_named_as_averaged(tmp_path):
    report = _report(tmp_path, "averaged")
    assert "GA208" in _errors(report) and "GA204" not in _errors(report), [
        (f.code, f.message) for f in report.findings
    ]
    assert report.verdict.split(". ")[1].startswith("GA208")


def test_a_float32_norm_that_overflowed_on_a_finite_gradient_is_named_as_overflow(tmp_path):
    report = _report(tmp_path, "overflow")
    assert "GA209" in _errors(report) and not _errors(report) & {"GA204", "GA401"}, [
        (f.code, f.message) for f in report.findings
    ]
    assert report.global_norm == pytest.approx(1e20, rel=1e-6)
