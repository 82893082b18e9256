"""Which optimizer steps an audit captures (steps=/every= of audit_step, begin_audit and the
integrations): a list of step numbers, or every N-th step."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import CaptureError


@dataclass(frozen=True, kw_only=True)
class StepSelection:
    """Step numbers count optimizer steps from 1 (the first optimizer step of the run is step 1)."""

    steps: frozenset[int] = frozenset()
    """The step numbers audited (used when `every` is None)."""
    every: int | None = None
    """Audit every N-th step instead; None to use `steps`."""

    def wants(self, step: int) -> bool:
        if self.every is not None:
            return step % self.every == 0
        return step in self.steps


def select_steps(steps: Iterable[int] | int | None, every: int | None) -> StepSelection:
    """The selection for `steps=[...]` or `every=N` (neither: step 1 only); both given is a mistake."""
    if steps is not None and every is not None:
        raise CaptureError("pass steps=[...] or every=N, not both")
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise CaptureError(
                f"every= must be a positive int (audit every N-th optimizer step), got {every!r}"
            )
        return StepSelection(every=every)
    if steps is None:
        return StepSelection(steps=frozenset({1}))
    chosen = (steps,) if isinstance(steps, int) else tuple(steps)
    for step in chosen:
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise CaptureError(f"steps= takes optimizer step numbers counted from 1, got {step!r}")
    return StepSelection(steps=frozenset(chosen))
