"""GA301-GA304: did every rank apply one coefficient to every parameter, the one the true norm asks for?"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..analysis.diagnosis import RankDiagnosis, StepDiagnosis
from ..analysis.param_coefs import LEFT_OUT, LISTED_TWICE, PER_CALL, CoefGroup, ParamCoefficients, clusters
from ..norms import relative_difference
from .base import (
    Analysis,
    AuditOptions,
    CheckResult,
    Hit,
    Skip,
    count,
    first_names,
    listing,
    num,
    ranks_named,
)

MIXED_MOMENTS = (
    "clipping ran several times (GA501) and the dump holds the gradient from before the first call but "
    "the clipped one from after the last: no coefficient is derived across the two moments"
)

SOURCE_TEXT: dict[str | None, str] = {
    "gradients": "measured from the pre- and post-clip gradients",
    "reported": "as reported",
    "reported_norm": "derived from the reported norm",
}


BY_PARAMETER = (
    "parameters received different coefficients (GA304), so no one coefficient per rank is to compare: "
    "GA304 compares each with the expected one"
)


def coefficients_differ(inputs: Analysis, options: AuditOptions) -> CheckResult:
    diagnosis = inputs.diagnosis
    if diagnosis.mixed_moments:
        return Skip(reason=MIXED_MOMENTS)
    found = inputs.param_coefficients
    if found is not None and found.differ and not found.disagreeing:
        return ()  # every parameter received one coefficient on all its ranks: a rank's mean is no coefficient
    known = [(d.rank, d.applied_coef) for d in diagnosis.ranks.values() if d.applied_coef is not None]
    if len(known) < 2:
        return Skip(reason="fewer than two ranks have a known applied coefficient")
    if any(math.isnan(c) for _, c in known):
        known = [(r, c) for r, c in known if not math.isnan(c)]
        if len(known) < 2:
            return Skip(reason="the applied coefficients are nan (a nonfinite norm, see GA401)")
    groups = clusters(known, diagnosis.rtol)
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


def coefficient_vs_expected(inputs: Analysis, options: AuditOptions) -> CheckResult:
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
    if inputs.param_coefficients is not None and inputs.param_coefficients.differ:
        return Skip(reason=BY_PARAMETER)  # a rank applied several coefficients to its own parameters
    if diagnosis.true_norm is None:
        return _above_bound(diagnosis, known)
    # A rank may rightly have applied the step's expected coefficient or, when its copies of replicated
    # pieces drifted (GA601), the one its own copies give.
    wrong = [
        d
        for d in known
        if not any(
            _close(d.applied_coef, e, diagnosis.rtol) for e in (diagnosis.expected_coef, d.expected_coef)
        )
    ]
    moment = f" {diagnosis.moment}" if diagnosis.moment else ""
    lead = "the last clip call's coefficient: " if diagnosis.moment else ""
    return _wrong_coefficients(
        diagnosis,
        wrong,
        f"{lead}the true global norm {num(diagnosis.true_norm)}{moment} with max_norm "
        f"{num(diagnosis.max_norm)} asks for coefficient {num(diagnosis.expected_coef)}",
        lambda d: _expected_text(diagnosis, d),
        true_norm=diagnosis.true_norm,
        expected_clip_coef=diagnosis.expected_coef,
    )


def _wrong_coefficients(
    diagnosis: StepDiagnosis,
    wrong: list[RankDiagnosis],
    asks: str,
    extra: Callable[[RankDiagnosis], str] = lambda d: "",
    **evidence: float | None,
) -> CheckResult:
    """One hit for the ranks that applied a wrong coefficient: what the norm `asks` for, but what they
    applied, the ranks grouped by the coefficient, its source (and `extra`), first rank first."""
    if not wrong:
        return ()
    alike: dict[tuple[str, str | None, str], list[int]] = {}
    for d in wrong:
        alike.setdefault((num(d.applied_coef), d.coef_source, extra(d)), []).append(d.rank)
    details = [
        f"{ranks_named(ranks)} applied {coef} ({SOURCE_TEXT.get(source, source)}){tail}"
        for (coef, source, tail), ranks in sorted(alike.items(), key=lambda kv: kv[1][0])[:6]
    ]
    return (
        Hit(
            message=f"{asks}, but {listing(details, len(alike), 'more coefficients')}",
            ranks=tuple(d.rank for d in wrong),
            evidence={
                **evidence,
                "max_norm": diagnosis.max_norm,
                "applied_clip_coef": wrong[0].applied_coef,
                "rtol": diagnosis.rtol,
            },
        ),
    )


def _close(a: float | None, b: float | None, rtol: float) -> bool:
    return a is not None and b is not None and relative_difference(a, b) <= rtol


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
    return _wrong_coefficients(
        diagnosis,
        wrong,
        f"the true global norm is at least {num(bound)} ({diagnosis.true_norm_note}; a bound from the "
        f"present ranks), so max_norm {num(diagnosis.max_norm)} asks for a coefficient of at most {num(limit)}",
        true_norm_lower_bound=bound,
        expected_clip_coef_upper_bound=limit,
    )


def post_clip_norm(inputs: Analysis, options: AuditOptions) -> CheckResult:
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
            ranks=tuple(inputs.step.ranks_present),
            evidence={
                "post_clip_norm": diagnosis.post_clip_norm,
                "max_norm": diagnosis.max_norm,
                "rtol": diagnosis.rtol,
            },
        ),
    )


MAX_PARAMS_PER_HIT = 100
"""Parameters a GA304 finding carries in `params` (its evidence counts them all)."""


def coefficients_by_parameter(inputs: Analysis, options: AuditOptions) -> CheckResult:
    found = inputs.param_coefficients
    if found is None:
        return Skip(reason="the coefficients per parameter were not measured")
    if found.note:
        return Skip(reason=found.note)
    if not found.differ:
        return ()
    diagnosis = inputs.diagnosis
    expected = _asks_for(diagnosis, found)
    if found.cause == PER_CALL:
        calls = _call_norms_text(inputs)
        return tuple(
            _group_hit(found, g, _per_call_text(g, calls, len(found.groups)) + expected) for g in found.groups
        )
    first, lead = found.groups[0], "at the last clip call: " if found.moment else ""
    return tuple(
        _group_hit(found, g, lead + _against_first(found, first, g) + expected, first)
        for g in found.groups[1:]
    )


def _params_text(params: tuple[str, ...]) -> str:
    listed, text = first_names(params)
    return text + (f" ({count(len(params), 'parameter')})" if len(params) > len(listed) else "")


def _against_first(found: ParamCoefficients, first: CoefGroup, group: CoefGroup) -> str:
    one = len(group.params) == 1
    them, were, their = ("it", "was", "its") if one else ("them", "were", "their")
    head = (
        f"{_params_text(group.params)} received clip coefficient {num(group.coef)} on every rank holding "
        f"{them}, the other {count(len(first.params), 'parameter')} {num(first.coef)}"
    )
    if found.cause == LISTED_TWICE and group.power >= 2:
        times = "twice" if group.power == 2 else f"{group.power} times"
        repeated = (
            f" ({num(found.repeated_norm)}, the true norm with {them} counted {times})"
            if found.repeated_norm is not None
            else ""
        )
        return (
            f"{head}: {num(group.coef)} is {num(first.coef)}{'²' if group.power == 2 else f'^{group.power}'}, "
            f"so {them} {were} scaled {times}, as a parameter listed {times} in the clip list is (a tied "
            f"weight listed under each of its names), and {their} squares were counted {times} in the clip "
            f"norm{repeated}"
        )
    if found.cause == LEFT_OUT and group.power == 0:
        return f"{head}: {them} {were} not scaled at all, as a parameter left out of the clip list is"
    return head


def _per_call_text(group: CoefGroup, calls: str, num_groups: int) -> str:
    source = (
        f"from clip call{'s' if len(group.calls) > 1 else ''} {', '.join(map(str, group.calls))} only"
        if group.calls
        else "(no clip call scaled them)"
    )
    return (
        f"{_params_text(group.params)} received clip coefficient {num(group.coef)} {source}, one of "
        f"{num_groups} coefficients of one step: each clip call ({calls}) scaled only its own parameters by "
        "its own norm, as clipping once per optimizer param group does"
    )


def _call_norms_text(inputs: Analysis) -> str:
    step = inputs.step
    for rank in step.ranks_present:
        clip = step.ranks[rank].clip
        if clip is not None and clip.calls:
            norms = ", ".join(num(c.reported_norm) for c in clip.calls)
            return f"{count(len(clip.calls), 'call')}, reported norms {norms}"
    return "several calls"


def _asks_for(diagnosis: StepDiagnosis, found: ParamCoefficients) -> str:
    if found.expected_coef is None:
        return ""
    spans = found.cause == PER_CALL and diagnosis.call_norms
    norm = diagnosis.call_norms[0].norm if spans else diagnosis.true_norm
    moment = " before the first clip call" if spans else f" {found.moment}" if found.moment else ""
    return (
        f"; the true global norm {num(norm)}{moment} with max_norm {num(diagnosis.max_norm)} asks for "
        f"{num(found.expected_coef)} for every parameter"
    )


def _group_hit(
    found: ParamCoefficients, group: CoefGroup, message: str, first: CoefGroup | None = None
) -> Hit:
    evidence: dict[str, int | float | str | None] = {
        "clip_coef": group.coef,
        "expected_clip_coef": found.expected_coef,
        "num_params": len(group.params),
        "cause": found.cause or "unrecognised",
        "measured_from": "values" if found.by_values else "sums of squares",
    }
    if first is not None:
        evidence["others_clip_coef"] = first.coef
        evidence["power"] = group.power
    if group.calls:
        evidence["clip_calls"] = ", ".join(map(str, group.calls))
    return Hit(
        message=message,
        ranks=group.ranks,
        params=group.params[:MAX_PARAMS_PER_HIT],
        evidence=evidence,
    )
