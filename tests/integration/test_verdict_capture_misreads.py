"""Stacks the capture used to misread, on real gloo ranks: FSDP1 ignored_modules (left out, so a
correct run got GA204 + GA302). Megatron-style experts are in test_verdict_expert_parallel.py."""

from __future__ import annotations

import pytest
import verdict_workers
from launcher import run_ranks
from models import reference_grads_tiny
from reassemble import norm_of

from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import load_step

pytestmark = pytest.mark.integration


def test_a_correct_fsdp1_run_with_ignored_modules_audits_clean_with_them_as_replicas(tmp_path):
    (step_dir, *_) = run_ranks(verdict_workers.fsdp1_ignored_modules, 2, (str(tmp_path),), timeout_s=180)
    step = load_step(step_dir)
    assert {"norm.weight", "norm.bias"} <= set(step.params)
    report = audit_step_dir(step_dir, AuditOptions())
    errors = {f.code for f in report.findings if f.severity.value == "error"}
    assert errors == set(), [(f.code, f.message) for f in report.findings]
    assert report.global_norm == pytest.approx(norm_of(reference_grads_tiny()), rel=1e-5)
