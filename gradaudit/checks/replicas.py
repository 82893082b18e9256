"""GA601: pieces that should be replicas of each other differ."""

from __future__ import annotations

import math

from ..norms import norm_rtol
from ..steptable import ReplicaSet
from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, count, num, ranks_named

MAX_PARAMS_IN_MESSAGE = 5
TINY = 1e-30


GUARD = "guard"
"""The capture_api of a step the guard measured: its copies are its own sums over each copy, made by
one kernel over bytes the stack's reduction makes identical on every replica, so any difference is one."""
GUARD_MEASURED = frozenset({GUARD, "guard.params", "guard.spike"})
"""The capture_apis whose copies the guard measured, compared exactly (see GUARD): its ownership
groups' sums, and the per-parameter pieces' norms of its GA601 and spike dumps (live/spike_dump.py),
each measured by the same kernel on the same bytes."""


def replica_tolerance(rs: ReplicaSet, *, exact: bool = False) -> float:
    """How far copies may drift: the dtype's norm tolerance times the copy's scale (values or
    fingerprint); none when `exact` (the guard's own sums, see GUARD)."""
    if exact:
        return TINY
    rtol = norm_rtol([rs.dtype])
    if rs.by_values:
        return rtol * rs.base_max_abs + TINY
    return rtol * math.sqrt(rs.numel * rs.base_sum_sq) + TINY


def differing_copies(rs: ReplicaSet, *, exact: bool = False) -> list[tuple[int, float]]:
    """(rank, how far it is from the base copy) for every copy beyond tolerance."""
    tol = replica_tolerance(rs, exact=exact)
    found: list[tuple[int, float]] = []
    for copy in rs.copies:
        if rs.by_values:
            diff = copy.max_abs_diff or 0.0
            if copy.num_nonfinite_mismatch or diff > tol:
                found.append((copy.rank, math.inf if copy.num_nonfinite_mismatch else diff))
        elif copy.fingerprint_delta is not None and copy.fingerprint_delta > tol:
            found.append((copy.rank, copy.fingerprint_delta))
    return found


def replicas_differ(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step, m = inputs.step, inputs.measurements

    if step.clip is not None and inputs.diagnosis.mixed_moments:
        return Skip(
            reason="clipping ran several times (GA501) and the dumped gradient is from before the first call, "
            "a partial gradient that accumulation may not have reduced yet"
        )
    sets = [rs for pm in m.params.values() for rs in pm.replica_sets]
    if not sets:
        return Skip(reason="no parameter piece is held on more than one present rank")
    exact = all(step.ranks[r].capture_api in GUARD_MEASURED for r in step.ranks_present)
    bad = []
    for rs in sets:
        copies = differing_copies(rs, exact=exact)
        if copies:
            bad.append((rs, copies))
    if not bad:
        return ()
    bad.sort(
        key=lambda item: (
            -max(d for _, d in item[1]) / replica_tolerance(item[0], exact=exact),
            item[0].param,
        )
    )
    lines = []
    for rs, copies in bad[:MAX_PARAMS_IN_MESSAGE]:
        what = "max |difference|" if rs.by_values else "fingerprint difference"
        worst_rank, worst = max(copies, key=lambda c: c[1])
        lines.append(
            f"{rs.param}: {ranks_named(r for r, _ in copies)} differ from rank {rs.base_rank}, "
            f"worst rank {worst_rank} by {what} {num(worst)} "
            + (
                "(the guard's sums of the copies, equal bit for bit on replicas)"
                if exact
                else f"(tolerance {num(replica_tolerance(rs))})"
            )
        )
    if len(bad) > MAX_PARAMS_IN_MESSAGE:
        lines.append(f"and {len(bad) - MAX_PARAMS_IN_MESSAGE} more replicated pieces")
    ranks = sorted({r for _, copies in bad for r, _ in copies})
    worst_rs, worst_copies = bad[0]
    return (
        Hit(
            message=f"{count(len(bad), 'replicated piece')} disagree between ranks "
            + (
                "(a rank-local fault, or a missing all-reduce): "
                if exact
                else "(a missing or wrong all-reduce): "
            )
            + "; ".join(lines),
            ranks=tuple(ranks),
            params=tuple(sorted({rs.param for rs, _ in bad})),
            evidence={
                "num_differing_pieces": len(bad),
                "worst_param": worst_rs.param,
                "worst_difference": max(d for _, d in worst_copies),
                "compared_by": "values" if worst_rs.by_values else "fingerprint",
            },
        ),
    )
