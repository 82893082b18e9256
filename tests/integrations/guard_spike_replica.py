"""The guard's `spike=` rule and its replica check (GA601) under a framework integration, which passes
them through its guard keywords: the workers' side (the step numbers, each parameter's Σg² at the
spike step, the flipped bit) and the tests' side (what a run must show), shared by the integrations'
guard tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from replica_fault_workers import flip_one_bit

from gradaudit.live.spike import MIN_KNOWN, MOST_NAMED, shares_text, top_shares
from gradaudit.ranksets import compact_ranks

__all__ = [
    "FLIP_STEP",
    "FLIP_STEPS",
    "SPIKE",
    "SPIKE_STEP",
    "SPIKE_STEPS",
    "TARGET_SCALE",
    "assert_one_spike",
    "assert_replica_fault",
    "flip_one_bit",
    "sum_sq_per_param",
]

SPIKE = 10.0
"""The `spike=` factor the integrations pass through."""
SPIKE_STEP = MIN_KNOWN + 1
"""The first step the rule can call a spike (it needs MIN_KNOWN norms before it)."""
SPIKE_STEPS = SPIKE_STEP + 1
"""The spike runs go one step further: the step after the spike is none."""
TARGET_SCALE = 100.0
"""The spike step's targets (or loss) are scaled by this: its gradient by about as much."""
FLIP_STEP = 2
FLIP_STEPS = 3
"""The replica runs: one bit flipped at FLIP_STEP, the step after captured in full."""


def sum_sq_per_param(named_parameters) -> dict[str, float]:
    """Each parameter's Σg² from its full gradient (a DTensor's full_tensor(): a collective every rank of
    its mesh must join), named without DDP's `module.` prefix. Read after a clip it gives the same
    shares: the clip multiplies every gradient by one coefficient."""
    sums = {}
    for name, param in named_parameters:
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        sums[name.removeprefix("module.")] = float(grad.double().square().sum())
    return sums


def assert_one_spike(runs: list[dict], sums: dict[str, float], step_dir: Path, cli) -> None:
    """`runs`: each rank's result of a run with spike=SPIKE whose SPIKE_STEP had its targets scaled
    (anomalies, warnings, dumps; rank 0's with the trend); `sums`: every parameter's Σg² at that step.
    Only that step is marked in the trend, rank 0's warning names the parameters holding most of its
    Σg², and each rank's spike dump is under step_dir, which `gradaudit check` passes and reads alike."""
    names = sorted(sums)
    expected = top_shares(names, [sums[n] for n in names])
    assert len(expected) == min(MOST_NAMED, len(names)) and expected[0][1] > 0
    assert [line["step"] for line in runs[0]["trend"] if line.get("spike")] == [SPIKE_STEP]
    said = [w for w in runs[0]["warnings"] if "a spike" in w]
    assert len(said) == 1 and said[0].startswith(f"gradaudit guard: step {SPIKE_STEP}: a spike: true norm")
    assert shares_text(expected) in said[0]
    assert f"gradaudit check {step_dir}" in said[0]
    for run in runs:
        assert run["anomalies"] == []
        assert [Path(dump).parent for dump in run["dumps"]] == [step_dir]
    code, out, _ = cli("check", str(step_dir), "--format", "json")
    report = json.loads(out)
    assert code == 0, report["findings"]
    top = report["sum_sq_shares"]["top"]
    assert [entry["param"] for entry in top][: len(expected)] == [name for name, _ in expected]
    for entry, (_, share) in zip(top, expected, strict=False):
        assert entry["share"] == pytest.approx(share, rel=1e-5)


def assert_replica_fault(runs: list[dict], holders: tuple[int, ...]) -> None:
    """`runs`: each rank's result of a run whose rank among `holders` (the ranks holding the copy) had
    one bit of its gradient copy flipped after the reduction at FLIP_STEP: GA601 at that step on every
    rank, nothing before it, and rank 0's warning names the holders. Two copies: either may be the
    faulty one, so both are named (a majority of three or more names the one rank)."""
    for run in runs:
        steps = dict(run["anomalies"])
        assert "GA601" in steps.get(FLIP_STEP, []), run["anomalies"]
        assert min(steps) == FLIP_STEP
    said = " ".join(runs[0]["warnings"])
    assert f"step {FLIP_STEP}: " in said
    assert len(holders) == 2
    assert f"ranks {compact_ranks(holders)} hold copies over group" in said
    assert "a rank-local fault on one of them" in said
