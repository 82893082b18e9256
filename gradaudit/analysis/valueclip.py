"""Element-wise clipping (clip by value) of a step: from its recorded clip_grad_value_ calls, or
recognised from the clamp it leaves. After such a clamp every piece's largest |element| is min(its
own before, v) for one v, at least one piece was cut to v, and its norm shrank less than its largest
element did (a common scale factor shrinks both alike). GA506 reports it; the norm checks read it to
say they have no norm or coefficient to check."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..model import StepFacts
from ..steptable import StepTable

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


def value_clipping(step: StepFacts, table: StepTable) -> ValueClipping | None:
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
    return _clamp(table)


def _clamp(table: StepTable) -> ValueClipping | None:
    """The clamp every piece holding a gradient before and after clipping shows, from their columns."""
    pre, post = table.grad, table.clipped
    if post is None:
        return None  # no gradient after clipping: nothing to read the before of
    both = pre.has & post.has
    if not both.any():
        return None
    pre_sq, pre_max = pre.sum_sq[both], pre.max_abs[both]
    post_sq, post_max = post.sum_sq[both], post.max_abs[both]
    value = float(post_max.max())
    if not math.isfinite(value) or value <= 0:
        return None
    target = np.minimum(pre_max, value)
    # math.isclose(post, target, rel_tol=CLAMP_RTOL) of each piece
    close = (post_max == target) | (
        np.isfinite(post_max)
        & np.isfinite(target)
        & (np.abs(post_max - target) <= CLAMP_RTOL * np.maximum(np.abs(post_max), np.abs(target)))
    )
    if not close.all():
        return None  # some piece was scaled otherwise: not one clamp
    cut = np.flatnonzero((pre_max > value * (1 + 1e-4)) & (pre_sq > 0))
    with np.errstate(all="ignore"):
        shrunk = np.sqrt(post_sq[cut] / pre_sq[cut]) > (value / pre_max[cut]) * (1 + 1e-4)
    ranks = table.rank[both][cut[shrunk]]
    if not ranks.size:
        return None
    return ValueClipping(
        clip_value=value, ranks=tuple(sorted(set(ranks.tolist()))), recognised="the clamp it left"
    )
