"""Mixture of experts with Megatron-style expert parallelism on 4 real gloo ranks: the capture places
`local_experts.<i>` by expert-parallel rank, a correct run audits clean, and a norm that gets only the
experts wrong is named as such (GA207), not as a norm that matches nothing."""

from __future__ import annotations

import pytest
import verdict_workers
from launcher import run_ranks

from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import load_step

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("moe")
    found = {}
    for mistake in ("none", "experts_over_dp", "experts_dropped"):
        (step_dir, *_) = run_ranks(
            verdict_workers.moe_expert_parallel, 4, (str(out_root), mistake), timeout_s=180
        )
        found[mistake] = step_dir
    return found


def _errors(report):
    return {f.code for f in report.findings if f.severity.value == "error"}


def test_megatron_style_experts_are_captured_under_their_global_expert_number(steps):
    step = load_step(steps["none"])
    experts = sorted({p for p in step.params if "local_experts" in p})
    assert [e.split(".")[3] for e in experts[::2]] == ["0", "1", "2", "3"]
    holders = {}
    for rank in step.ranks_present:
        for piece in step.ranks[rank].pieces:
            holders.setdefault(piece.param, set()).add(rank)
    assert holders["mlp.experts.local_experts.1.weight"] == {0, 2}
    assert holders["mlp.experts.local_experts.2.weight"] == {1, 3}


def test_a_correct_expert_parallel_run_audits_clean(steps):
    report = audit_step_dir(steps["none"], AuditOptions())
    assert _errors(report) == set(), [(f.code, f.message) for f in report.findings]
    assert {row.diagnosis for row in report.ranks} == {"correct"}


def test_expert_squares_reduced_over_the_data_parallel_world_name_the_experts(steps):
    report = audit_step_dir(steps["experts_over_dp"], AuditOptions())
    assert "GA207" in _errors(report) and "GA204" not in _errors(report), [
        (f.code, f.message) for f in report.findings
    ]
    ga207 = next(f for f in report.findings if f.code == "GA207")
    assert "'local_experts' parameters" in ga207.message
    assert report.verdict.split(". ")[1].startswith("GA207")


def test_experts_left_out_of_the_norm_are_named_as_left_out(steps):
    report = audit_step_dir(steps["experts_dropped"], AuditOptions())
    assert "GA207" in _errors(report) and "GA204" not in _errors(report), [
        (f.code, f.message) for f in report.findings
    ]
    ga207 = next(f for f in report.findings if f.code == "GA207")
    assert "left out of the norm" in ga207.message and ga207.evidence["hypothesis"] == "local_experts:dropped"
