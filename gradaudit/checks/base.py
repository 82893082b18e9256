"""What every check shares: its options, its result type, and the spec it is registered with."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ranksets import compact_ranks
from ..report import Finding, NotChecked, Severity

if TYPE_CHECKING:  # for type checking only, so that `gradaudit explain` loads no measuring code
    from ..engine.measure import StepMeasurements
    from ..model import StepDump


@dataclass(frozen=True, kw_only=True)
class AuditOptions:
    """Choices the user made that change what the audit reads and what the checks decide."""

    reference: str | None = None
    """A folder holding one unsharded reference step (or step_<N> folders), compared by GA602/GA603."""
    rtol: float | None = None
    """Relative tolerance for the reference comparison (GA602/GA603); None: chosen by dtype."""
    atol: float | None = None
    """Absolute tolerance for the reference comparison; None: chosen by dtype."""
    allow_incomplete_ranks: bool = False
    """An unreadable rank file becomes a missing rank with its reason instead of stopping the audit."""

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Hit:
    """One problem a check found; the registry adds its code, severity and title to make a Finding."""

    message: str
    ranks: tuple[int, ...] = ()
    params: tuple[str, ...] = ()
    evidence: Mapping[str, int | float | str | None] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Skip:
    """The check could not decide, and why."""

    reason: str


CheckResult = tuple[Hit, ...] | Skip
CheckFn = Callable[["StepDump", "StepMeasurements", "AuditOptions"], CheckResult]


@dataclass(frozen=True, kw_only=True)
class Explanation:
    """The fixed sections `gradaudit explain CODE` prints."""

    what: str
    why: str
    example: str
    fix: str


@dataclass(frozen=True, kw_only=True)
class CheckSpec:
    code: str
    severity: Severity
    title: str
    explanation: Explanation
    run: CheckFn
    needs_all_ranks: bool = True
    """A clean result is only a pass when every rank was there; with ranks missing it is "not checked"."""

    def apply(
        self, step: StepDump, measurements: StepMeasurements, options: AuditOptions
    ) -> list[Finding] | NotChecked:
        result = self.run(step, measurements, options)
        if result == () and self.needs_all_ranks and step.missing_ranks:
            result = Skip(
                reason=f"nothing found on the ranks present, but some are missing ({ranks_named(step.missing_ranks)})"
            )
        if isinstance(result, Skip):
            return NotChecked(code=self.code, title=self.title, reason=result.reason)
        from .folding import fold_hits

        return [
            Finding(
                code=self.code,
                severity=self.severity,
                title=self.title,
                message=hit.message,
                ranks=tuple(sorted(set(hit.ranks))),
                params=tuple(sorted(set(hit.params))),
                evidence=dict(sorted(hit.evidence.items())),
            )
            for hit in fold_hits(result)
        ]


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as compact text: "0-3, 6"."""
    return compact_ranks(ranks) or "none"


def ranks_named(ranks: Iterable[int]) -> str:
    """ "rank 3" or "ranks 0-3, 6"."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"


def count(n: int, noun: str) -> str:
    """ "1 parameter", "3 parameters"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def num(value: float | None) -> str:
    """A number for a message: 6 significant digits, nan/inf spelled out, "unknown" for None."""
    if value is None:
        return "unknown"
    return f"{value:.6g}"
