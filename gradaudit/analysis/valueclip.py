"""Element-wise clipping (clip by value) of a step: from its recorded clip_grad_value_ calls, or
recognised from the clamp it leaves. After such a clamp every piece's largest |element| is min(its
own before, v) for one v, at least one piece was cut to v, and its norm shrank less than its largest
element did (a common scale factor shrinks both alike). GA506 reports it; the norm checks read it to
say they have no norm or coefficient to check."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..measure.measurements import StepMeasurements
from ..model import StepDump

CLAMP_RTOL = 1e-6
"""Elements clamped to v hold v itself in their dtype, so max |x| after the clamp is v to float rounding."""


@dataclass(frozen=True, kw_only=True)
class ValueClipping:
    """A step that clipped element-wise: the value, the ranks, and how it was recognised."""

    clip_value: float
    """The value every gradient element was clamped to [-clip_value, clip_value]."""
    ranks: tuple[int, ...]
    """The ranks that clipped element-wise (their recorded call, or their pieces cut to the value)."""
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
