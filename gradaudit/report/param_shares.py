"""Where Σg² is: the parameters holding most of a step's true sum of squares of the gradients (each
element once), as a spike dump's report shows them beside each rank's share."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..steptable import StepTable

SPIKE_TRIGGER = "guard.spike"
"""The dump metadata's `trigger` of a step gradaudit.guard wrote because its true norm spiked (its
pieces are the parameters, so the report can say which hold most of Σg²)."""
MOST_REPORTED = 10
"""The largest parameters' shares a report holds (with the number of parameters they are among)."""


@dataclass(frozen=True, kw_only=True)
class ParamShare:
    """One parameter's part of a step's Σg²."""

    param: str
    """The logical parameter."""
    sum_sq: float
    """Its gradient's sum of squares, each element once (replicas through the lowest rank's copy)."""
    share: float
    """`sum_sq` over the step's Σg², in [0, 1]."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"{self.param}: a share of Σg² lies in [0, 1], got {self.share}")


@dataclass(frozen=True, kw_only=True)
class SumSqShares:
    """The parameters holding most of a step's Σg², largest first, or why they are not known."""

    sum_sq: float
    """The step's Σg² (each element once, of the ranks present); nan or inf when not finite."""
    num_params: int
    """Parameters with a gradient in the dump, of which `top` are the largest."""
    top: tuple[ParamShare, ...] = ()
    """At most MOST_REPORTED, largest share first, ties by name; empty when `reason` says why."""
    reason: str = ""
    """Why there are no shares (a nonfinite or zero Σg²); "" when `top` holds them."""
    note: str = ""
    """What the guard saw when it wrote the step (its true norm against the recent median)."""


def ranked_shares(names: Sequence[str], sums: Sequence[float], most: int) -> tuple[ParamShare, ...]:
    """The `most` largest shares of sum(sums), largest first, equal ones by name; () when the sum is
    not finite and above 0 (no share is then meaningful)."""
    if len(names) != len(sums):
        raise ValueError(f"{len(names)} names for {len(sums)} sums of squares: give one sum per name")
    if most < 1:
        raise ValueError(f"most must be at least 1, got {most}")
    if any(not math.isfinite(s) or s < 0 for s in sums):
        return ()
    total = math.fsum(sums)
    if not (math.isfinite(total) and total > 0):
        return ()
    largest = heapq.nsmallest(most, range(len(names)), key=lambda i: (-sums[i], names[i]))
    return tuple(ParamShare(param=names[i], sum_sq=sums[i], share=min(1.0, sums[i] / total)) for i in largest)


def sum_sq_shares(table: StepTable, *, most: int = MOST_REPORTED, note: str = "") -> SumSqShares:
    """The parameters holding most of Σg² among a measured step's pieces: each layout once, through its
    lowest-rank copy (the cover the true norm counts), the pieces without a gradient left out."""
    import numpy as np

    grad = table.grad
    cover = table.cover
    cover = cover[grad.has[cover]]
    sums, params = grad.sum_sq[cover], table.param[cover]
    held = np.unique(params)
    num_params = int(held.size)
    nonfinite = grad.counts[cover].any()
    if nonfinite or not np.isfinite(sums).all():
        why = "the gradients hold nan or inf values (GA401)" if nonfinite else "it overflows float64"
        return SumSqShares(
            sum_sq=math.inf if not nonfinite else math.nan,
            num_params=num_params,
            reason=f"Σg² is not finite: {why}, so no parameter's share is known",
            note=note,
        )
    per_param = np.bincount(params, weights=sums, minlength=len(table.param_names))[held]
    names = [table.param_names[p] for p in held.tolist()]
    total = math.fsum(sums.tolist())
    top = ranked_shares(names, per_param.tolist(), most) if total > 0 else ()
    return SumSqShares(
        sum_sq=total,
        num_params=num_params,
        top=top,
        reason="" if top else "every gradient is zero: Σg² is 0",
        note=note,
    )
