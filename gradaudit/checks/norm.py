"""GA201-GA210: which norm did clipping use, compared with the true global norm?"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import NamedTuple

from ..analysis.diagnosis import RankDiagnosis, StepDiagnosis
from ..analysis.hypotheses import (
    AVERAGED,
    DOUBLE_COUNTED,
    EVERY_COPY,
    LISTED_TWICE,
    LOCAL_ONLY,
    OVERFLOW,
    PARAM_GROUP,
    PER_PARAM_GROUP,
    UNEXPLAINED,
    WRONG_GROUP,
)
from ..norms import CLIP_EPS
from ..report.sentences import fold_sentences
from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, listing, num, ranks_named

MAX_RANKS_IN_MESSAGE = 4
MAX_CANDIDATES_IN_MESSAGE = 16
Evidence = Mapping[str, int | float | str | None]


def diagnosis_or_skip(inputs: Analysis) -> StepDiagnosis | Skip:
    if inputs.step.clip is None:
        return Skip(reason="no rank recorded what its clipping did (no clip record in the dump)")
    diagnosis = inputs.diagnosis
    if diagnosis.true_norm is None and diagnosis.norm_lower_bound is None:
        return Skip(reason=f"the true global norm is unknown: {diagnosis.true_norm_note}")
    if all(d.hypothesis is None for d in diagnosis.ranks.values()):
        if diagnosis.true_norm is None:
            return Skip(
                reason=f"the true global norm is unknown ({diagnosis.true_norm_note}) and no rank's norm is "
                f"below {num(diagnosis.norm_lower_bound)}, the lower bound the present ranks give"
            )
        repeated = [d.rank for d in diagnosis.ranks.values() if d.num_clip_calls > 1]
        if repeated and diagnosis.mixed_moments:
            return Skip(
                reason=f"{ranks_named(repeated)} clipped several times before one step (see GA501); "
                "their norms are of partial gradients"
            )
        return Skip(reason="no rank reported a norm or applied a coefficient below 1 that could be matched")
    return diagnosis


def _ranks_with(diagnosis: StepDiagnosis, kind: str) -> list[RankDiagnosis]:
    """The ranks whose clipping used an accounting of this kind (of loss-scaled gradients or not)."""
    return [
        d
        for d in diagnosis.ranks.values()
        if not d.logging_bug and d.hypothesis is not None and d.hypothesis.kind == kind
    ]


def _evidence_lines(ranks: list[RankDiagnosis]) -> str:
    # Ranks whose explanations differ only in their numbers share one sentence with a rank range.
    folded = fold_sentences([(d.rank, d.detail) for d in ranks])
    lines = [f"{ranks_named(f.ranks)}: {f.text}" for f in folded[:MAX_RANKS_IN_MESSAGE]]
    if len(folded) > MAX_RANKS_IN_MESSAGE:
        rest = [rank for f in folded[MAX_RANKS_IN_MESSAGE:] for rank in f.ranks]
        lines.append(f"{ranks_named(rest)}: explained alike, with other numbers (see the per-rank table)")
    return "; ".join(lines)


def _update_unaffected(diagnosis: StepDiagnosis, ranks: list[RankDiagnosis]) -> bool:
    """Whether clipping by the wrong norm left this step alone: coefficient 1 expected and applied."""
    max_norm = diagnosis.max_norm
    if diagnosis.expected_coef != 1.0 or max_norm is None:
        return False
    return all(
        d.applied_coef == 1.0
        if d.applied_coef is not None
        else d.reported_norm is not None and d.reported_norm + CLIP_EPS <= max_norm
        for d in ranks
    )


def _hit(diagnosis: StepDiagnosis, ranks: list[RankDiagnosis], lead: str, extra: Evidence) -> Hit:
    first = ranks[0]
    if diagnosis.true_norm is None:
        truth = (
            f"true global norm at least {num(diagnosis.norm_lower_bound)} ({diagnosis.true_norm_note}; a lower "
            f"bound from the present ranks), expected coefficient at most {num(diagnosis.coef_upper_bound)}"
        )
    else:
        moment = f" {diagnosis.moment}" if diagnosis.moment else ""
        truth = f"true global norm {num(diagnosis.true_norm)}{moment}, expected coefficient {num(diagnosis.expected_coef)}"
    message = f"{lead} on {ranks_named(d.rank for d in ranks)}: {truth}. {_evidence_lines(ranks)}"
    if any(d.hypothesis is not None and d.hypothesis.loss_scaled for d in ranks):
        message += f" (computed on gradients still multiplied by the loss scale {num(diagnosis.loss_scale)}: see GA502)"
    if _update_unaffected(diagnosis, ranks):
        message += (
            ". This step's update was unaffected: the true norm is below max_norm, so the coefficient is 1 "
            "either way; the wrong norm changes the update from the first step whose true norm is above max_norm"
        )
    evidence: dict[str, int | float | str | None] = {
        "true_norm": diagnosis.true_norm,
        "expected_clip_coef": diagnosis.expected_coef,
        "reported_norm": first.reported_norm,
        "local_norm": first.local_norm,
        "applied_clip_coef": first.applied_coef,
        "matched_norm": None
        if first.reported_match is None or first.reported_match.candidate is None
        else first.reported_match.candidate.value,
        "rtol": diagnosis.rtol,
        **extra,
    }
    if diagnosis.norm_lower_bound is not None:
        evidence["true_norm_lower_bound"] = diagnosis.norm_lower_bound
    return Hit(message=message, ranks=tuple(d.rank for d in ranks), evidence=evidence)


class _Mistake(NamedTuple):
    """An accounting mistake a norm check reports: its hypothesis kind, the lead of its finding (a
    template of the hypothesis' `what`, or a function of it), the evidence key that gives `what` (None:
    not given; "param" also names it as the finding's parameter) and further evidence."""

    kind: str
    lead: str | Callable[[str], str]
    key: str | None = "hypothesis"
    extra: Evidence | None = None


def _by_kind(inputs: Analysis, *mistakes: _Mistake) -> CheckResult:
    """One hit per hypothesis of these kinds, for the ranks whose clipping used it."""
    diagnosis = diagnosis_or_skip(inputs)
    if isinstance(diagnosis, Skip):
        return diagnosis
    hits = []
    for kind, lead, key, extra in mistakes:
        by_what: dict[str, list[RankDiagnosis]] = {}
        for d in _ranks_with(diagnosis, kind):
            by_what.setdefault(d.hypothesis.what if d.hypothesis is not None else "", []).append(d)
        for what, ranks in sorted(by_what.items()):
            text = lead.format(what) if isinstance(lead, str) else lead(what)
            hit = _hit(diagnosis, ranks, text, {**({} if key is None else {key: what}), **(extra or {})})
            hits.append(replace(hit, params=(what,)) if key == "param" else hit)
    return tuple(hits)


def local_norm(inputs: Analysis, options: AuditOptions) -> CheckResult:
    lead = "clipping used each rank's local norm, never reduced across ranks"
    return _by_kind(inputs, _Mistake(LOCAL_ONLY.kind, lead, key=None))


def double_counted(inputs: Analysis, options: AuditOptions) -> CheckResult:
    every_copy = (
        "clipping used a norm that counts every copy: each rank of group {!r} computed the group's "
        "full norm and their squares were summed over the group again"
    )
    return _by_kind(
        inputs,
        _Mistake(
            DOUBLE_COUNTED.kind,
            "clipping used a norm that counts every replica of replicated gradients",
            None,
        ),
        _Mistake(EVERY_COPY, every_copy, key="group"),
    )


def wrong_group(inputs: Analysis, options: AuditOptions) -> CheckResult:
    return _by_kind(
        inputs, _Mistake(WRONG_GROUP, "clipping reduced the norm over process group {!r} only", "group")
    )


_HOW = {
    "dropped": "left out of the norm",
    "every_copy": "counted on every rank that holds a replica",
    "local": "taken from each rank's own pieces only",
}


def _group_lead(what: str) -> str:
    label, how = what.split(":", 1)
    text = _HOW.get(how) or f"reduced over process group {how.split(':', 1)[1]!r} instead"
    return f"clipping used a norm in which the {label!r} parameters are {text}, the rest counted right"


def param_group_mistake(inputs: Analysis, options: AuditOptions) -> CheckResult:
    return _by_kind(inputs, _Mistake(PARAM_GROUP, _group_lead))


def averaged_norms(inputs: Analysis, options: AuditOptions) -> CheckResult:
    lead = "clipping used per-rank norms averaged over process group {!r} instead of their squares summed"
    return _by_kind(inputs, _Mistake(AVERAGED, lead))


def overflowed(inputs: Analysis, options: AuditOptions) -> CheckResult:
    lead = "clipping's norm overflowed to inf in {} although every gradient value is finite"
    return _by_kind(inputs, _Mistake(OVERFLOW, lead))


def wrong_clip_list(inputs: Analysis, options: AuditOptions) -> CheckResult:
    """GA210: the right reduction of a wrong list of parameters: one listed twice, or each param group's
    own list, one clip call per group (the evidence's cause picks the fix line)."""
    listed_twice = (
        "clipping used a norm that counts parameter {!r} twice (it is listed twice in the clip list, as a "
        "tied weight listed under both of its names is)"
    )
    per_call = (
        "each clip call used the norm of its own parameters only (one clip call per optimizer param group), "
        "never the norm of all of them together"
    )
    calls = inputs.diagnosis.num_clip_calls
    return _by_kind(
        inputs,
        _Mistake(LISTED_TWICE, listed_twice, "param", {"cause": "listed_twice"}),
        _Mistake(PER_PARAM_GROUP, per_call, None, {"cause": "per_call", "num_clip_calls": calls}),
    )


def unexplained(inputs: Analysis, options: AuditOptions) -> CheckResult:
    lead = "clipping used a norm that matches no known accounting mistake"
    found = _by_kind(inputs, _Mistake(UNEXPLAINED.kind, lead, key=None))
    if isinstance(found, Skip) or not found:
        return found
    first = inputs.diagnosis.ranks[found[0].ranks[0]]
    tried = first.candidates
    shown = [f"{c.hypothesis.text} {num(c.value)}" for c in tried[:MAX_CANDIDATES_IN_MESSAGE]]
    candidates = listing(shown, len(tried), sep=", ")
    return (
        replace(
            found[0], message=f"{found[0].message}. Candidates tried for rank {first.rank}: {candidates}"
        ),
    )


def logging_bug(inputs: Analysis, options: AuditOptions) -> CheckResult:
    diagnosis = diagnosis_or_skip(inputs)
    if isinstance(diagnosis, Skip):
        return diagnosis
    ranks = [d for d in diagnosis.ranks.values() if d.logging_bug]
    if not ranks:
        return ()
    first = ranks[0]
    assert first.reported_match is not None  # a logging bug is a reported norm that matched
    message = (
        f"wrong reported norm but right applied coefficient on {ranks_named(d.rank for d in ranks)}: "
        f"rank {first.rank} reported {num(first.reported_norm)} ({first.reported_match.hypothesis.text}) while the true "
        f"global norm is {num(diagnosis.true_norm)} and its applied coefficient {num(first.applied_coef)} implies "
        f"{num(first.implied_norm)}; clipping is right, the logged number is not"
    )
    return (
        Hit(
            message=message,
            ranks=tuple(d.rank for d in ranks),
            evidence={
                "true_norm": diagnosis.true_norm,
                "reported_norm": first.reported_norm,
                "implied_norm": first.implied_norm,
                "applied_clip_coef": first.applied_coef,
                "reported_hypothesis": first.reported_match.hypothesis.text,
            },
        ),
    )


def not_checked(inputs: Analysis, options: AuditOptions) -> CheckResult:
    """GA206: the norm checks could not run for lack of evidence, said as a warning rather than left
    for the reader to notice among the "not checked" lines (a step that clipped several times is GA501's)."""
    from .coefficients import coefficient_vs_expected

    diagnosis = diagnosis_or_skip(inputs)
    if not isinstance(diagnosis, Skip) or inputs.diagnosis.num_clip_calls > 1:
        return ()
    coefficient = coefficient_vs_expected(inputs, options)
    if not isinstance(coefficient, Skip):
        return ()  # the applied coefficients were checked: GA302 speaks for clipping
    reason = diagnosis.reason
    if coefficient.reason != reason:
        reason += f"; and {coefficient.reason}"
    return (
        Hit(
            message=f"clipping not checked: {reason}; nothing in this report says clipping was right",
            ranks=tuple(inputs.step.ranks_present),
            evidence={"reason": reason},
        ),
    )
