"""GA506: element-wise clipping (clip by value) instead of norm clipping, and the norm checks it leaves
without a question to answer.

A `clip_grad_value_` call is recorded as such when it is intercepted (`ClipCall.clip_value`); one the
audit did not see is recognised from the clamp it leaves: after it, every piece's largest |element| is
min(its own before, v) for one v, at least one piece was cut to v, and its norm shrank less than its
largest element did (a common scale factor shrinks both alike)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engine.measure import StepMeasurements
from ..model import StepDump
from .base import AuditOptions, CheckResult, Hit, num, ranks_named

NORM_CLIPPING_CODES = (
    "GA201",
    "GA202",
    "GA203",
    "GA204",
    "GA205",
    "GA206",
    "GA207",
    "GA208",
    "GA209",
    "GA301",
    "GA302",
    "GA303",
    "GA504",
    "GA505",
)
"""The checks of a norm and its coefficient: with element-wise clipping there is neither to check."""

CLAMP_RTOL = 1e-6
"""Elements clamped to v hold v itself in their dtype, so max |x| after the clamp is v to float rounding."""


@dataclass(frozen=True, kw_only=True)
class ValueClipping:
    clip_value: float
    ranks: tuple[int, ...]
    recognised: str
    """How it was recognised: "the recorded clip_grad_value_ call" or "the clamp it left"."""
    only: bool = True
    """No recorded call clipped by norm: the norm checks have nothing to check."""


def value_clipping(step: StepDump, m: StepMeasurements) -> ValueClipping | None:
    """The step's element-wise clipping, from its recorded calls or from the clamp it left; else None."""
    values = {
        rank: call.clip_value
        for rank in step.ranks_present
        if (clip := step.ranks[rank].clip) is not None
        for call in clip.calls
        if call.clip_value is not None
    }
    if values:
        return ValueClipping(
            clip_value=max(values.values()),
            ranks=tuple(sorted(values)),
            recognised="the recorded clip_grad_value_ call",
        )
    return _clamp(m)


def _clamp(m: StepMeasurements) -> ValueClipping | None:
    pairs = [
        (piece.rank, piece.stats["grad"], piece.stats["grad_clipped"])
        for piece in m.pieces
        if "grad" in piece.stats and "grad_clipped" in piece.stats
    ]
    if not pairs:
        return None
    value = max(post.max_abs for _, _, post in pairs)
    if not math.isfinite(value) or value <= 0:
        return None
    cut = []
    for rank, pre, post in pairs:
        if not math.isclose(post.max_abs, min(pre.max_abs, value), rel_tol=CLAMP_RTOL):
            return None  # some piece was scaled otherwise: not one clamp
        if pre.max_abs > value * (1 + 1e-4) and pre.sum_sq > 0:
            shrink = value / pre.max_abs
            if math.sqrt(post.sum_sq / pre.sum_sq) > shrink * (1 + 1e-4):
                cut.append(rank)
    if not cut:
        return None
    return ValueClipping(clip_value=value, ranks=tuple(sorted(set(cut))), recognised="the clamp it left")


def gate(step: StepDump, m: StepMeasurements) -> str | None:
    """Why the norm-clipping checks do not apply to this step (it clipped element-wise), or None."""
    found = m.derived("value_clipping", step, lambda: value_clipping(step, m))
    if found is None or not found.only:
        return None
    return (
        f"the step clipped element-wise (clip_grad_value_ at {num(found.clip_value)}, recognised from "
        f"{found.recognised}), not by norm: there is no clip norm or coefficient to check (GA506)"
    )


def clipped_by_value(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    found = m.derived("value_clipping", step, lambda: value_clipping(step, m))
    if found is None:
        return ()
    clip = step.clip
    declared = "" if clip is None else f" although max_norm {num(clip.max_norm)} was declared"
    not_checked = (
        "Not checked therefore: which norm clipping used and the coefficient every rank applied (GA201-GA209, "
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
