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
    cover = list(table.rows(table.cover[table.has_update[table.cover]]))
    if not cover:
        stats = any(step.ranks[r].mode == "stats" for r in step.ranks_present)
        return Skip(
            reason="parameters before and after the optimizer step were not dumped with values"
            + (
                " (a stats-mode dump keeps parameter values only for full_params= patterns)"
                if stats
                else f" ({record_parameters_hint(step)})"
            )
        )
    partial = len(cover) < everything
    update_norm = math.sqrt(safe_fsum(p.update_sum_sq for p in cover if p.update_sum_sq is not None))
    clipped = all("grad_clipped" in p.stats for p in cover)
    grad_norm = cover_norm(cover, 2.0, "grad_clipped" if clipped else "grad")
    if grad_norm is None or not math.isfinite(grad_norm) or not math.isfinite(update_norm):
        return Skip(
            reason=f"the gradient or update norm is not finite ({num(grad_norm)}, {num(update_norm)}; see GA401)"
        )
    which = "clipped gradient" if clipped else "gradient (before clipping)"
    ratio = update_norm / grad_norm if grad_norm else math.inf
    over = f"over the {len(cover)} of {everything} pieces dumped with parameter values: " if partial else ""
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
                **({"num_pieces": len(cover), "num_pieces_in_step": everything} if partial else {}),
            },
        ),
    )
