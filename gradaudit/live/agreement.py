"""What every rank concludes from the stamps of a gathered step before judging it: whether the ranks
took part in the same step, whether one left, skipped an optimizer step, failed to measure, or saw
its parameters change. Every rank reads the same rows, so every rank reaches the same conclusion and
acts on it at the same point of the exchanges. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .summary import CHANGED, CLOCK, FAILED, OFF, SKIP, STEP

if TYPE_CHECKING:
    import numpy as np

Conclusion = Literal["judge", "off", "out_of_step", "skipped_step", "failed", "changed", "not_measured"]


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """What the ranks conclude from one gathered step (the same on every rank)."""

    conclusion: Conclusion
    """judge: every rank measured the same step; off: a rank's guard left, every rank's stops;
    out_of_step: the ranks' exchanges stand for different steps, every rank's guard stops;
    skipped_step: `ranks` ran one optimizer step fewer than the others; failed: `ranks` could not
    measure the step; changed: a rank's parameters changed, ownership is inferred again;
    not_measured: every rank took part without measuring (paused, or a step captured in full)."""
    ranks: tuple[int, ...] = ()
    """The ranks the conclusion is about."""
    detail: str = ""
    """The evidence in words, for the warning."""


def agree(rows: np.ndarray) -> Agreement:
    """The conclusion from every rank's row of a gathered step (see summary.HEADER)."""
    status = rows[:, 0]
    every = range(rows.shape[0])
    left = tuple(r for r in every if status[r] == OFF)
    if left:
        return Agreement(conclusion="off", ranks=left)
    steps = rows[:, STEP]
    if (steps != steps[0]).any():
        numbers = ", ".join(f"rank {r} at step {int(steps[r])}" for r in every)
        return Agreement(conclusion="out_of_step", detail=numbers)
    clocks = rows[:, CLOCK]
    if (clocks != clocks[0]).any():
        least = clocks.min()
        ahead = tuple(r for r in every if clocks[r] > least)
        detail = f"{int(clocks[ahead[0]])} training forward passes to the others' {int(least)}"
        return Agreement(conclusion="skipped_step", ranks=ahead, detail=detail)
    failed = tuple(r for r in every if status[r] == FAILED)
    if failed:
        return Agreement(conclusion="failed", ranks=failed)
    changed = tuple(r for r in every if rows[r, CHANGED] == 1.0)
    if changed:
        return Agreement(conclusion="changed", ranks=changed)
    skipping = tuple(r for r in every if status[r] == SKIP)
    if skipping:
        return Agreement(conclusion="not_measured", ranks=skipping)
    return Agreement(conclusion="judge")
