"""GA506: element-wise clipping (clip by value) instead of norm clipping, and the norm checks it leaves
without a question to answer (what was recognised is analysis.valueclip's, in `Analysis.value_clipping`)."""

from __future__ import annotations

from .base import Analysis, AuditOptions, CheckResult, Hit, num, ranks_named


def gate(inputs: Analysis) -> str | None:
    """Why the norm-clipping checks do not apply to this step (it clipped element-wise), or None."""
    found = inputs.value_clipping
    if found is None or not found.only:
        return None
    return (
        f"the step clipped element-wise (clip_grad_value_ at {num(found.clip_value)}, recognised from "
        f"{found.recognised}), not by norm: there is no clip norm or coefficient to check (GA506)"
    )


def clipped_by_value(inputs: Analysis, options: AuditOptions) -> CheckResult:
    found = inputs.value_clipping
    if found is None:
        return ()
    clip = inputs.step.clip
    declared = "" if clip is None else f" although max_norm {num(clip.max_norm)} was declared"
    not_checked = (
        "Not checked therefore: which norm clipping used and the coefficient every rank applied (GA201-GA210, "
        "GA301-GA303). "
        if found.only
        else ""
    )
    return (
        Hit(
            message=(
                f"{ranks_named(found.ranks)} clipped element-wise{declared}: every gradient element was clamped to "
                f"[-{num(found.clip_value)}, {num(found.clip_value)}] (recognised from {found.recognised}). That is "
                "no norm clipping: it changes the gradient's direction, and it bounds no norm of the step (a "
                f"gradient of n elements may keep norm up to sqrt(n) x the value). {not_checked}If norm "
                "clipping was meant, call clip_grad_norm_ (or the stack's clip) instead"
            ),
            ranks=found.ranks,
            evidence={"clip_value": found.clip_value, "recognised": found.recognised},
        ),
    )
