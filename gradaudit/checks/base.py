"""What every check receives and returns (options, inputs, hits, skips, the spec of a check), the
folding of many findings of one code into one, and the small wording helpers the checks share."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..ranksets import compact_ranks
from ..report.model import Finding, NotChecked, Severity

if TYPE_CHECKING:  # for type checking only, so that `gradaudit explain` loads no measuring code
    from ..analysis.coverage import ParamCoverage
    from ..analysis.diagnosis import StepDiagnosis
    from ..analysis.param_coefs import ParamCoefficients
    from ..analysis.updates import UpdateJudgement
    from ..analysis.valueclip import ValueClipping
    from ..model import StepFacts
    from ..steptable import StepMeasurements, StepTable


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
class Analysis:
    """The analysis value, what every check receives: the step's facts, its step table and what was
    read from its tensors, and what the analysis made of them (audit.analyse builds it once per step,
    from a loaded dump or the guard's gathered numbers; the checks only read it)."""

    step: StepFacts
    """The loaded step."""
    measurements: StepMeasurements
    """What was read from its tensors (and the reference's)."""
    table: StepTable
    """Every measured piece of the step, as frozen columns (what the analysis and the checks ask of the pieces)."""
    diagnosis: StepDiagnosis
    """The true global norm, the expected coefficient and each rank's diagnosis."""
    coverage: Mapping[str, ParamCoverage]
    """Parameter -> who holds which of its elements (GA102 and GA103 read it)."""
    update_judgements: Mapping[str, UpdateJudgement]
    """Parameters whose next weights differ from the reference while their gradients agree, judged
    through the optimizer ({} without a reference): GA603 leaves out the explained ones, GA604 names them."""
    value_clipping: ValueClipping | None
    """The step's element-wise clipping (clip_grad_value_), recorded or recognised from its clamp; None
    when it clipped by norm or not at all (GA506 names it; the norm checks are then not checked)."""
    param_coefficients: ParamCoefficients | None = None
    """The coefficient each parameter received, grouped by the coefficient they share (GA304 names the
    parameters of a step that received several); None when the analysis did not measure them."""


@dataclass(frozen=True, kw_only=True)
class Hit:
    """One problem a check found; the registry adds its code, severity and title to make a Finding."""

    message: str
    """What was found, with the numbers; becomes `Finding.message`."""
    ranks: tuple[int, ...] = ()
    """The ranks it concerns."""
    params: tuple[str, ...] = ()
    """The parameters it concerns."""
    evidence: Mapping[str, int | float | str | None] = field(default_factory=dict)
    """The numbers behind the message, by name."""


@dataclass(frozen=True, kw_only=True)
class Skip:
    """The check could not decide, and why."""

    reason: str
    """Why, as the report's "not checked" line prints it."""


CheckResult = tuple[Hit, ...] | Skip
CheckFn = Callable[["Analysis", "AuditOptions"], CheckResult]


@dataclass(frozen=True, kw_only=True)
class CheckSpec:
    """One finding code: everything gradaudit knows about it (a row of registry.CHECKS)."""

    code: str
    """GAnnn; the family is the hundreds digit. Never reused."""
    severity: Severity
    """The severity of every finding of this code."""
    title: str
    """One line, printed with every finding of this code and by `gradaudit explain --all`."""
    run: CheckFn
    """The check: (inputs, options) -> hits, or a Skip saying why it could not decide."""
    verdict_rank: int
    """Where this code stands when the verdict names one finding of several: lower first (causes
    before their consequences). Distinct per code, spaced by 10 so a new code can go between two."""
    what: str
    """What the check looks at (the sections `gradaudit explain CODE` prints: what, why, example, fix)."""
    why: str
    """Why a finding of it matters to training."""
    example: str
    """A training mistake that raises it."""
    fix: str
    """How to fix it; `checks/fixes.py` picks the line for the dump's stack."""
    decided_with_ranks_missing: bool = False
    """A clean result stands with ranks missing; otherwise it is "not checked" when ranks are missing."""
    decides_clipping: bool = False
    """The verdict calls clipping right only when every such check ran (none was "not checked")."""
    norm_clipping: bool = False
    """A check of a clip norm or its coefficient: "not checked" when the step clipped element-wise (GA506)."""

    def apply(self, inputs: Analysis, options: AuditOptions) -> list[Finding] | NotChecked:
        result = self.run(inputs, options)
        step = inputs.step
        if result == () and not self.decided_with_ranks_missing and step.missing_ranks:
            result = Skip(
                reason=f"nothing found on the ranks present, but some are missing ({ranks_named(step.missing_ranks)})"
            )
        if isinstance(result, Skip):
            return NotChecked(code=self.code, title=self.title, reason=result.reason)
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


def ranks_named(ranks: Iterable[int]) -> str:
    """ "rank 3" or "ranks 0-3, 6"."""
    ranks = sorted(set(ranks))
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)}"


def count(n: int, noun: str) -> str:
    """ "1 parameter", "3 parameters"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def num(value: float | None) -> str:
    """A number for a message: 6 significant digits, nan/inf spelled out, "unknown" for None."""
    return "unknown" if value is None else f"{value:.6g}"


def listing(texts: Sequence[str], total: int, more: str = "more", sep: str = "; ") -> str:
    """`texts`, of the first of `total` items, joined; then "and N more" for the items left out."""
    return sep.join([*texts, f"and {total - len(texts)} {more}"] if total > len(texts) else texts)


MAX_FINDINGS_PER_CODE = 100
"""Findings one check reports in full; the rest fold into one more. Rank lists fold into ranges
already (render/fold.py folds the per-rank rows the same way for the human renderers)."""
MAX_FOLDED_PARAMS_LISTED = 10
"""Parameter names a folded finding lists (its evidence counts them all)."""


def first_names(names: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """The first MAX_FOLDED_PARAMS_LISTED names, and them as text ending in ", …" when there are more."""
    listed = tuple(names[:MAX_FOLDED_PARAMS_LISTED])
    return listed, ", ".join(listed) + (", …" if len(names) > len(listed) else "")


def fold_hits(hits: Sequence[Hit]) -> tuple[Hit, ...]:
    """`hits` unchanged when at most MAX_FINDINGS_PER_CODE, else the first MAX_FINDINGS_PER_CODE - 1
    (in report order: ranks, then parameters, then message) and one hit standing for all the others:
    their ranks (all of them), their first parameters, and counts of both in its evidence."""
    if len(hits) <= MAX_FINDINGS_PER_CODE:
        return tuple(hits)
    ordered = sorted(
        hits, key=lambda h: (tuple(sorted(set(h.ranks))), tuple(sorted(set(h.params))), h.message)
    )
    kept, rest = ordered[: MAX_FINDINGS_PER_CODE - 1], ordered[MAX_FINDINGS_PER_CODE - 1 :]
    ranks = sorted({r for hit in rest for r in hit.ranks})
    params = sorted({p for hit in rest for p in hit.params})
    listed, text = first_names(params)
    named = f" ({text})" if listed else ""
    on_ranks = f" on {ranks_named(ranks)}" if ranks else ""
    folded = Hit(
        message=(
            f"{count(len(rest), 'more finding')} of this code, folded into one: "
            f"{count(len(params), 'parameter')}{named}{on_ranks}; the first of them: {rest[0].message}"
        ),
        ranks=tuple(ranks),
        params=listed,
        evidence={"folded_findings": len(rest), "folded_params": len(params)},
    )
    return (*kept, folded)
