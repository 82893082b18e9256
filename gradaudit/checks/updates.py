"""GA701: how large the optimizer's update was, next to the clipped gradient."""

from __future__ import annotations

import math

from ..analysis.norm_input import cover_norm
from ..norms import safe_fsum
from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, num
from .hints import record_parameters_hint


def update_vs_gradient(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    table = inputs.table
    everything = table.cover.size
    cover = table.cover[table.has_update[table.cover]]
    if not cover.size:
        stats = any(step.ranks[r].mode == "stats" for r in step.ranks_present)
        return Skip(
            reason="parameters before and after the optimizer step were not dumped with values"
            + (
                " (a stats-mode dump keeps parameter values only for full_params= patterns)"
                if stats
                else f" ({record_parameters_hint(step)})"
            )
        )
    partial = cover.size < everything
    update_norm = math.sqrt(safe_fsum(table.update_sum_sq[cover]))
    after = table.clipped
    clipped = after is not None and bool(after.has[cover].all())
    grad_norm = cover_norm(table, cover, after if after is not None and clipped else table.grad, 2.0)
    if grad_norm is None or not math.isfinite(grad_norm) or not math.isfinite(update_norm):
        return Skip(
            reason=f"the gradient or update norm is not finite ({num(grad_norm)}, {num(update_norm)}; see GA401)"
        )
    which = "clipped gradient" if clipped else "gradient (before clipping)"
    ratio = update_norm / grad_norm if grad_norm else math.inf
    over = f"over the {cover.size} of {everything} pieces dumped with parameter values: " if partial else ""
    return (
        Hit(
            message=(
                f"{over}the optimizer moved the parameters by L2 norm {num(update_norm)}; the {which} had L2 "
                f"norm {num(grad_norm)} (ratio {num(ratio)}). Gradient clipping bounds the gradient, not an "
                "adaptive optimizer's update: monitor the update norm separately if it matters"
            ),
            evidence={
                "update_norm": update_norm,
                "gradient_norm": grad_norm,
                "ratio": ratio,
                "gradient_kind": "grad_clipped" if clipped else "grad",
                **({"num_pieces": cover.size, "num_pieces_in_step": everything} if partial else {}),
            },
        ),
    )
