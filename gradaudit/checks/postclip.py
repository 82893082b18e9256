"""GA503: the dumped gradients are evidently the clipped ones, so the audit could not see what clipping saw."""

from __future__ import annotations

import math

from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, num, ranks_named


def captured_after_clipping(inputs: Analysis, options: AuditOptions) -> CheckResult:
    """Gradients with no recorded clip call whose global norm is max_norm itself (what clip_grad_norm_
    leaves: max_norm * N / (N + 1e-6)), with a recorded norm above max_norm when there is one."""
    step = inputs.step
    clips = [step.ranks[r].clip for r in step.ranks_present]
    if any(c is not None and c.calls for c in clips):
        return ()  # audit.clip recorded the gradients before each call: they are pre-clip by construction
    diagnosis = inputs.diagnosis
    if diagnosis.max_norm is None:
        return Skip(reason="no rank recorded max_norm (no clip record in the dump)")
    if diagnosis.true_norm is None or not math.isfinite(diagnosis.true_norm):
        return Skip(reason="the global norm of the dumped gradients is unknown or nonfinite")
    max_norm, dumped = diagnosis.max_norm, diagnosis.true_norm
    if abs(dumped - max_norm) > diagnosis.rtol * max_norm:
        return ()
    reported = {
        r: c.reported_norm
        for r, c in zip(step.ranks_present, clips, strict=True)
        if c is not None and c.reported_norm is not None
    }
    above = {r: v for r, v in reported.items() if v > max_norm * (1 + diagnosis.rtol)}
    if reported and not above:
        return ()  # the run's own norm was at or below max_norm: gradients at max_norm prove nothing
    because = (
        f"while {ranks_named(above)} recorded a norm of {num(max(above.values()))} before clipping"
        if above
        else "which is what clipping leaves behind"
    )
    return (
        Hit(
            message=(
                f"the dumped gradients' global norm {num(dumped)} equals max_norm {num(max_norm)}, {because}: they "
                "were captured after clipping, so nothing about the clipping itself could be checked. Capture "
                "before the clip call (audit.clip, or the framework's gradaudit callback)"
            ),
            ranks=tuple(above) or tuple(step.ranks_present),
            evidence={
                "dumped_norm": dumped,
                "max_norm": max_norm,
                "reported_norm": max(above.values()) if above else None,
                "rtol": diagnosis.rtol,
            },
        ),
    )
