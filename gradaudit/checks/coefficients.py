"""GA301-GA303: did every rank apply one coefficient, the one the true norm asks for?"""

from __future__ import annotations

import math

from ..analysis.diagnosis import RankDiagnosis, StepDiagnosis
from ..norms import relative_difference
from .base import AuditInputs, AuditOptions, CheckResult, Hit, Skip, num, ranks_named

MIXED_MOMENTS = (
    "clipping ran several times (GA501) and the dump holds the gradient from before the first call but "
    "the clipped one from after the last: no coefficient is derived across the two moments"
)

SOURCE_TEXT: dict[str | None, str] = {
    "gradients": "measured from the pre- and post-clip gradients",
    "reported": "as reported",
    "reported_norm": "derived from the reported norm",
}


def _clusters(values: list[tuple[int, float]], rtol: float) -> list[list[tuple[int, float]]]:
    """Ranks grouped by coefficient: consecutive sorted values within `rtol` of the group's first."""
    groups: list[list[tuple[int, float]]] = []
    for rank, value in sorted(values, key=lambda rv: (rv[1], rv[0])):
        if groups and relative_difference(groups[-1][0][1], value) <= rtol:
            groups[-1].append((rank, value))
        else:
            groups.append([(rank, value)])
    return groups


def coefficients_differ(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    diagnosis = inputs.diagnosis
    if diagnosis.mixed_moments:
        return Skip(reason=MIXED_MOMENTS)
    known = [(d.rank, d.applied_coef) for d in diagnosis.ranks.values() if d.applied_coef is not None]
    if len(known) < 2:
        return Skip(reason="fewer than two ranks have a known applied coefficient")
    if any(math.isnan(c) for _, c in known):
        known = [(r, c) for r, c in known if not math.isnan(c)]
        if len(known) < 2:
            return Skip(reason="the applied coefficients are nan (a nonfinite norm, see GA401)")
    groups = _clusters(known, diagnosis.rtol)
    if len(groups) <= 1:
        return ()
    majority = max(groups, key=len)
    outliers = (
        [rv for g in groups if g is not majority for rv in g] if len(majority) > len(known) / 2 else known
    )
    described = "; ".join(
        f"{ranks_named(r for r, _ in g)}: {num(g[0][1])}" for g in sorted(groups, key=lambda g: g[0][0])
    )
    values = [c for _, c in known]
    return (
        Hit(
            message=f"ranks applied {len(groups)} different clip coefficients to one update ({described})",
            ranks=tuple(r for r, _ in outliers),
            evidence={
                "min_clip_coef": min(values),
                "max_clip_coef": max(values),
                "num_distinct": len(groups),
            },
        ),
    )


def coefficient_vs_expected(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    diagnosis = inputs.diagnosis
    if diagnosis.max_norm is None:
        return Skip(reason="no rank recorded max_norm (no clip record in the dump)")
    if diagnosis.mixed_moments:
        return Skip(reason=MIXED_MOMENTS)
    if diagnosis.true_norm is None and diagnosis.norm_lower_bound is None:
        return Skip(reason=f"the true global norm is unknown: {diagnosis.true_norm_note}")
    shown_norm = diagnosis.true_norm if diagnosis.true_norm is not None else diagnosis.norm_lower_bound
    if shown_norm is None or not math.isfinite(shown_norm):
        return Skip(reason=f"the true global norm is {num(shown_norm)} (nonfinite gradients, see GA401)")
    known = [d for d in diagnosis.ranks.values() if d.applied_coef is not None]
    if not known:
        return Skip(reason="no rank dumped post-clip gradients, a clip coefficient or a reported norm")
    if diagnosis.true_norm is None:
        return _above_bound(diagnosis, known)
    wrong = [
        d
        for d in known
        if not any(_close(d.applied_coef, e, diagnosis.rtol) for e in _expected_of(diagnosis, d))
    ]
    if not wrong:
        return ()
    alike: dict[tuple[str, str | None, str], list[int]] = {}
    for d in wrong:
        alike.setdefault((num(d.applied_coef), d.coef_source, _expected_text(diagnosis, d)), []).append(
            d.rank
        )
    details = "; ".join(
        f"{ranks_named(ranks)} applied {coef} ({SOURCE_TEXT.get(source, source)}){expected}"
        for (coef, source, expected), ranks in sorted(alike.items(), key=lambda kv: kv[1][0])[:6]
    )
    if len(alike) > 6:
        details += f"; and {len(alike) - 6} more coefficients"
    moment = f" {diagnosis.moment}" if diagnosis.moment else ""
    lead = "the last clip call's coefficient: " if diagnosis.moment else ""
    return (
        Hit(
            message=(
                f"{lead}the true global norm {num(diagnosis.true_norm)}{moment} with max_norm "
                f"{num(diagnosis.max_norm)} asks for coefficient {num(diagnosis.expected_coef)}, but {details}"
            ),
            ranks=tuple(d.rank for d in wrong),
            evidence={
                "true_norm": diagnosis.true_norm,
                "max_norm": diagnosis.max_norm,
                "expected_clip_coef": diagnosis.expected_coef,
                "applied_clip_coef": wrong[0].applied_coef,
                "rtol": diagnosis.rtol,
            },
        ),
    )


def _close(a: float | None, b: float | None, rtol: float) -> bool:
    return a is not None and b is not None and relative_difference(a, b) <= rtol


def _expected_of(diagnosis: StepDiagnosis, d: RankDiagnosis) -> tuple[float | None, ...]:
    """The coefficients a rank may rightly have applied: the step's expected one, or (when its copies
    of replicated pieces drifted, GA601) the one its own copies give."""
    return (diagnosis.expected_coef, d.expected_coef)


def _expected_text(diagnosis: StepDiagnosis, d: RankDiagnosis) -> str:
    if d.expected_coef is None or _close(d.expected_coef, diagnosis.expected_coef, diagnosis.rtol):
        return ""
    return (
        f", neither that nor {num(d.expected_coef)}, which the true norm {num(d.true_norm)} with rank {d.rank}'s "
        "own drifted replicas asks for (see GA601)"
    )


def _above_bound(diagnosis: StepDiagnosis, known: list[RankDiagnosis]) -> CheckResult:
    """With ranks missing: a coefficient above what the lower bound on the true norm allows is wrong."""
    bound, limit = diagnosis.norm_lower_bound, diagnosis.coef_upper_bound
    wrong = [
        d
        for d in known
        if limit is not None and d.applied_coef is not None and d.applied_coef > limit * (1 + diagnosis.rtol)
    ]
    if not wrong:
        return ()
    alike: dict[tuple[str, str | None], list[int]] = {}
    for d in wrong:
        alike.setdefault((num(d.applied_coef), d.coef_source), []).append(d.rank)
    details = "; ".join(
        f"{ranks_named(ranks)} applied {coef} ({SOURCE_TEXT.get(source, source)})"
        for (coef, source), ranks in sorted(alike.items(), key=lambda kv: kv[1][0])[:6]
    )
    return (
        Hit(
            message=(
                f"the true global norm is at least {num(bound)} ({diagnosis.true_norm_note}; a bound from the "
                f"present ranks), so max_norm {num(diagnosis.max_norm)} asks for a coefficient of at most "
                f"{num(limit)}, but {details}"
            ),
            ranks=tuple(d.rank for d in wrong),
            evidence={
                "true_norm_lower_bound": bound,
                "max_norm": diagnosis.max_norm,
                "expected_clip_coef_upper_bound": limit,
                "applied_clip_coef": wrong[0].applied_coef,
                "rtol": diagnosis.rtol,
            },
        ),
    )


def post_clip_norm(inputs: AuditInputs, options: AuditOptions) -> CheckResult:
    step = inputs.step
    diagnosis = inputs.diagnosis
    if diagnosis.max_norm is None:
        return Skip(reason="no rank recorded max_norm (no clip record in the dump)")
    if diagnosis.post_clip_norm is None:
        return Skip(reason="post-clip gradients (grad_clipped) were not dumped for every piece")
    if not math.isfinite(diagnosis.post_clip_norm):
        return Skip(
            reason=f"the post-clip norm is {num(diagnosis.post_clip_norm)} (nonfinite gradients, see GA401)"
        )
    limit = diagnosis.max_norm * (1 + diagnosis.rtol)
    bound = diagnosis.true_norm is None
    if diagnosis.post_clip_norm <= limit:
        if bound:
            return Skip(
                reason=f"{diagnosis.true_norm_note}: the post-clip norm of the present ranks, "
                f"{num(diagnosis.post_clip_norm)}, is only a lower bound"
            )
        return ()
    return (
        Hit(
            message=(
                f"after clipping, the global norm is {'at least ' if bound else ''}{num(diagnosis.post_clip_norm)}"
                f"{' (' + diagnosis.true_norm_note + ')' if bound else ''}, above max_norm "
                f"{num(diagnosis.max_norm)} (ratio {num(diagnosis.post_clip_norm / diagnosis.max_norm)})"
            ),
            ranks=tuple(step.ranks_present),
            evidence={
                "post_clip_norm": diagnosis.post_clip_norm,
                "max_norm": diagnosis.max_norm,
                "rtol": diagnosis.rtol,
            },
        ),
    )
