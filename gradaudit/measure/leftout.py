"""Parameters some rank left out of its dump: left out of the whole step, so that they are "not
checked" (GA104) everywhere instead of an ownership gap (GA103) or a norm short of their gradient."""

from __future__ import annotations

from ..dumpfile.dump import StepDump


def left_out_params(step: StepDump) -> frozenset[str]:
    """The parameters any present rank did not capture (listed in its `not_captured`).

    A rank leaves a parameter out when it cannot read or describe it (a sparse gradient, a layout it
    does not know, a read that failed); the other ranks' pieces of it then cover only part of it.
    Counting them would report the rest as held by no rank, and give a norm with part of the
    parameter in it: no norm and no coverage check counts such a parameter, and GA104 names the ranks
    and reasons."""
    return frozenset(p.name for rank in step.ranks_present for p in step.ranks[rank].not_captured)


def checked_params(step: StepDump) -> list[str] | None:
    """The parameters the norms count, or None for all of `step.params` (nothing was left out)."""
    left_out = left_out_params(step)
    if not left_out.intersection(step.params):
        return None
    return [name for name in step.params if name not in left_out]
