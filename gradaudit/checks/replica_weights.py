"""GA605: replicas whose parameters (not only their gradients) differ: the weights drifted apart, as the
step after one whose ranks applied different coefficients shows."""

from __future__ import annotations

from ..norms import norm_rtol
from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, count, listing, num, ranks_named

MAX_PARAMS_IN_MESSAGE = 5
TINY = 1e-30


def replica_weights_differ(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step, m = inputs.step, inputs.measurements
    replicated = [rs for pm in m.params.values() for rs in pm.replica_sets]
    sets = [rs for rs in replicated if rs.param_base_max_abs is not None]
    if not sets:
        if replicated and any("param_before" in step.ranks[r].tensor_kinds for r in step.ranks_present):
            return Skip(reason="the replicated pieces' parameters were not recorded on every copy")
        return ()  # nothing replicated, or no weights recorded at all (GA701 says so)
    bad = []
    for rs in sets:
        assert rs.param_base_max_abs is not None
        tol = norm_rtol([rs.dtype]) * rs.param_base_max_abs + TINY
        copies = [(c.rank, c.param_max_abs_diff) for c in rs.copies if (c.param_max_abs_diff or 0.0) > tol]
        if copies:
            bad.append((rs, copies, tol))
    if not bad:
        return ()
    bad.sort(key=lambda item: (-max(d or 0.0 for _, d in item[1]) / item[2], item[0].param))
    lines = [
        f"{rs.param}: {ranks_named(r for r, _ in copies)} differ from rank {rs.base_rank} by max |difference| "
        f"{num(max(d or 0.0 for _, d in copies))} (tolerance {num(tol)})"
        for rs, copies, tol in bad[:MAX_PARAMS_IN_MESSAGE]
    ]
    ranks = sorted({r for _, copies, _ in bad for r, _ in copies})
    worst, worst_copies, _ = bad[0]
    return (
        Hit(
            message=(
                f"the weights of {count(len(bad), 'replicated piece')} differ between ranks at the start of this "
                "optimizer step: replicas drifted apart in an earlier step (ranks that applied different "
                "coefficients, GA301, or skipped different steps), and every later step trains different "
                "models: " + listing(lines, len(bad), "more replicated pieces")
            ),
            ranks=tuple(ranks),
            params=tuple(sorted({rs.param for rs, _, _ in bad})),
            evidence={
                "num_differing_pieces": len(bad),
                "worst_param": worst.param,
                "worst_difference": max(d or 0.0 for _, d in worst_copies),
            },
        ),
    )
