"""The guard's `spike=` rule: when a checked step's true norm spikes against the recent ones (so that the
guard dumps the step's per-parameter statistics), and the words that name the parameters holding most
of its Σg². Pure: no torch, no I/O."""

from __future__ import annotations

import math
import numbers
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..errors import CaptureError
from ..report.param_shares import SPIKE_TRIGGER, ranked_shares

__all__ = [
    "MIN_KNOWN",
    "SPIKE_TRIGGER",
    "WINDOW",
    "SpikeOptionError",
    "SpikeRule",
    "SpikeTest",
    "SpikeWatch",
    "shares_text",
    "spike_watch",
    "top_shares",
]

WINDOW = 20
"""Checked steps whose true norms the median is taken of."""
MIN_KNOWN = 5
"""True norms known before any step is called a spike (a median of fewer says little)."""
MOST_NAMED = 3
"""Parameters a warning names."""

SpikeTest = Callable[[int, float, tuple[float, ...]], bool]
"""`(step, true_norm, recent_norms) -> bool`: the user's own rule; `recent_norms` holds the finite true
norms of the last checked steps, oldest first (at least MIN_KNOWN, at most the window)."""


class SpikeOptionError(CaptureError):
    """A `spike=` (or its window) the guard cannot use; raised when the guard is made."""


@dataclass(frozen=True, kw_only=True)
class SpikeRule:
    """When a checked step's true norm is a spike: above `factor` times the median of the last
    `window` finite true norms, or whatever `test` says; never before MIN_KNOWN norms are known."""

    factor: float | None = None
    """A step spikes when its true norm exceeds factor x the recent median (above 1)."""
    test: SpikeTest | None = field(default=None, compare=False)
    """The user's rule instead of `factor`."""
    window: int = WINDOW
    """How many of the last finite true norms the median (or `test`) sees."""

    def __post_init__(self) -> None:
        if (self.factor is None) == (self.test is None):
            raise SpikeOptionError(
                "a SpikeRule needs exactly one of factor= and test=; use SpikeRule.of(spike)"
            )
        if self.factor is not None and not (
            type(self.factor) in (int, float) and math.isfinite(self.factor) and self.factor > 1
        ):
            raise SpikeOptionError(
                f"spike must be a factor above 1 (say spike=10.0: a step whose true norm exceeds 10 times "
                f"the median of the last {self.window} checked steps) or a callable "
                f"(step, true_norm, recent_norms) -> bool, got {self.factor!r}"
            )
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < MIN_KNOWN:
            raise SpikeOptionError(
                f"the spike window must be an integer of at least {MIN_KNOWN} checked steps, got {self.window!r}"
            )

    @staticmethod
    def of(spike: float | SpikeTest, *, window: int = WINDOW) -> SpikeRule:
        """The rule of the guard's `spike=` argument: a factor above 1, or a callable."""
        if callable(spike):
            return SpikeRule(test=spike, window=window)
        if isinstance(spike, bool) or not isinstance(spike, numbers.Real):  # numpy's floats too
            raise SpikeOptionError(
                f"spike must be a factor above 1 (say spike=10.0) or a callable "
                f"(step, true_norm, recent_norms) -> bool, got {spike!r}"
            )
        return SpikeRule(factor=float(spike), window=window)

    def is_spike(self, step: int, true_norm: float | None, recent: Sequence[float]) -> bool:
        """Whether `true_norm` spikes against `recent` (the finite true norms of the last checked
        steps, oldest first; only the newest `window` are read). A nonfinite or unknown norm is no
        spike: its gradients are nonfinite, which GA401 names."""
        if true_norm is None or not math.isfinite(true_norm):
            return False
        known = tuple(recent[-self.window :])
        if len(known) < MIN_KNOWN:
            return False
        if self.test is not None:
            return bool(self.test(step, true_norm, known))
        assert self.factor is not None
        return true_norm > self.factor * statistics.median(known)

    def describe(self, true_norm: float, recent: Sequence[float]) -> str:
        """What made a step a spike, for its dump's note and the warning."""
        known = tuple(recent[-self.window :])
        median = statistics.median(known) if known else math.nan
        steps = f"the last {len(known)} checked steps"
        if median > 0:
            return (
                f"true norm {true_norm:.6g} is {true_norm / median:.3g}x the median {median:.6g} of {steps}"
            )
        return f"true norm {true_norm:.6g} against the median {median:.6g} of {steps}"


class SpikeWatch:
    """A SpikeRule with the true norms it has seen: ask `is_spike`, then `observe` the step's norm."""

    def __init__(self, rule: SpikeRule) -> None:
        self.rule = rule
        self._recent: deque[float] = deque(maxlen=rule.window)

    @property
    def recent(self) -> tuple[float, ...]:
        """The finite true norms of the last checked steps, oldest first."""
        return tuple(self._recent)

    def is_spike(self, step: int, true_norm: float | None) -> bool:
        return self.rule.is_spike(step, true_norm, tuple(self._recent))

    def observe(self, true_norm: float | None) -> None:
        """Count a checked step's true norm in the window (spikes too: the median shrugs them off);
        an unknown or nonfinite norm never enters it."""
        if true_norm is not None and math.isfinite(true_norm):
            self._recent.append(float(true_norm))

    def note(self, true_norm: float) -> str:
        """What made this step a spike (before it is observed): the spike dump's `trigger_note`."""
        return self.rule.describe(true_norm, tuple(self._recent))


def spike_watch(spike: float | SpikeTest | None, *, window: int = WINDOW) -> SpikeWatch | None:
    """The guard's watch of its `spike=` argument; None without one (the guard then dumps no spike)."""
    return None if spike is None else SpikeWatch(SpikeRule.of(spike, window=window))


def top_shares(
    names: Sequence[str], sum_sq_per_param: Sequence[float], most: int = MOST_NAMED
) -> tuple[tuple[str, float], ...]:
    """(name, share of Σg²) of the `most` parameters holding most of it, largest first, equal shares
    by name; () when Σg² is not finite and above 0. `sum_sq_per_param`: each parameter's gradient
    sum of squares, each element once."""
    return tuple((s.param, s.share) for s in ranked_shares(names, sum_sq_per_param, most))


def shares_text(shares: Sequence[tuple[str, float]]) -> str:
    """ "72% of Σg² in layers.11.mlp.w2, 9% in layers.10.mlp.w2" (top_shares' result); "" for none."""
    parts = [
        f"{_percent(share)}{' of Σg²' if i == 0 else ''} in {name}" for i, (name, share) in enumerate(shares)
    ]
    return ", ".join(parts)


def _percent(share: float) -> str:
    """A whole percent; "<1%" for a share that would read 0%."""
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"
