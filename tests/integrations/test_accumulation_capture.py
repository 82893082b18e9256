"""Per-clip-call evidence on a real FSDP2 run with accumulation and a clip after every micro-batch."""

from __future__ import annotations

import math

import pytest
from accumulation_workers import fsdp2_clip_per_microbatch
from launcher import run_ranks
from models import norm_of, reference_grads_tiny
from reassemble import audit_report, load, reassemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("accumulation")
    results = run_ranks(fsdp2_clip_per_microbatch, 2, (str(out_root),), timeout_s=180)
    return out_root / "fsdp2_clip_per_microbatch" / "step_1", results


def test_the_last_clip_calls_pre_clip_norm_from_the_dump_equals_the_single_process_norm(run):
    step_path, results = run
    expected = norm_of(reference_grads_tiny())
    assert results[0]["norms"][0] == 0.0  # the first call saw no gradient under no-sync
    assert results[0]["norms"][1] == pytest.approx(expected, rel=1e-5)
    step = load(step_path)
    assert norm_of(reassemble(step, "grad")) == pytest.approx(expected, rel=1e-5)


def test_every_piece_carries_the_statistics_of_both_calls_the_first_as_zeros(run):
    step_path, _ = run
    step = load(step_path)
    expected = norm_of(reference_grads_tiny())
    pieces = [p for dump in step.ranks.values() for p in dump.pieces]
    assert pieces and all(len(p.call_stats) == 2 for p in pieces)
    assert all(p.call_stats[0].sum_sq == 0.0 and p.call_stats[0].numel == p.numel for p in pieces)
    assert math.sqrt(sum(p.call_stats[1].sum_sq for p in pieces)) == pytest.approx(expected, rel=1e-5)
    for dump in step.ranks.values():
        assert [c.reported_norm for c in dump.clip.calls][1] == pytest.approx(expected, rel=1e-5)


def test_the_audit_names_clipping_more_than_once(run):
    step_path, _ = run
    report = audit_report(step_path)
    assert "GA501" in {f.code for f in report.findings}
