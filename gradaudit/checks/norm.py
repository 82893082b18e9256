"""GA201-GA205: which norm did clipping use, compared with the true global norm?"""

from __future__ import annotations

from ..diagnosis import (
    CORRECT,
    DOUBLE_COUNTED,
    LOCAL_ONLY,
    LOSS_SCALED,
    UNEXPLAINED,
    WRONG_GROUP,
    RankDiagnosis,
    StepDiagnosis,
    diagnose_step,
)
from ..engine.measure import StepMeasurements
from ..model import StepDump
from .base import AuditOptions, CheckResult, Hit, Skip, num, ranks_named

MAX_RANKS_IN_MESSAGE = 4


def base_hypothesis(hypothesis: str | None) -> tuple[str | None, bool]:
    """("local_only", True) for "loss_scaled:local_only": the mistake, and whether the loss scale was in it."""
    if hypothesis is not None and hypothesis.startswith(LOSS_SCALED + ":"):
        return hypothesis[len(LOSS_SCALED) + 1 :], True
    return hypothesis, False


def diagnosis_or_skip(step: StepDump, m: StepMeasurements) -> StepDiagnosis | Skip:
    if step.clip is None:
        return Skip(reason="no rank recorded what its clipping did (no clip record in the dump)")
    diagnosis = diagnose_step(step, m)
    if diagnosis.true_norm is None:
        return Skip(reason=f"the true global norm is unknown: {diagnosis.true_norm_note}")
    if all(d.hypothesis is None for d in diagnosis.ranks.values()):
        repeated = [d.rank for d in diagnosis.ranks.values() if d.num_clip_calls > 1]
        if repeated:
            return Skip(
                reason=f"{ranks_named(repeated)} clipped several times before one step (see GA501); "
                "their norms are of partial gradients"
            )
        return Skip(reason="no rank reported a norm or applied a coefficient below 1 that could be matched")
    return diagnosis


def _ranks_with(diagnosis: StepDiagnosis, wanted) -> list[RankDiagnosis]:
    return [
        d
        for d in diagnosis.ranks.values()
        if not d.logging_bug and d.hypothesis is not None and wanted(base_hypothesis(d.hypothesis)[0])
    ]


def _evidence_lines(diagnosis: StepDiagnosis, ranks: list[RankDiagnosis]) -> str:
    lines = [f"rank {d.rank}: {d.detail}" for d in ranks[:MAX_RANKS_IN_MESSAGE]]
    if len(ranks) > MAX_RANKS_IN_MESSAGE:
        lines.append(f"and {len(ranks) - MAX_RANKS_IN_MESSAGE} more ranks alike")
    return "; ".join(lines)


def _hit(diagnosis: StepDiagnosis, ranks: list[RankDiagnosis], lead: str) -> Hit:
    first = ranks[0]
    scaled = any(base_hypothesis(d.hypothesis)[1] for d in ranks)
    message = (
        f"{lead} on {ranks_named(d.rank for d in ranks)}: true global norm {num(diagnosis.true_norm)}, "
        f"expected coefficient {num(diagnosis.expected_coef)}. {_evidence_lines(diagnosis, ranks)}"
    )
    if scaled:
        message += f" (computed on gradients still multiplied by the loss scale {num(diagnosis.loss_scale)}: see GA502)"
    return Hit(
        message=message,
        ranks=tuple(d.rank for d in ranks),
        evidence={
            "true_norm": diagnosis.true_norm,
            "expected_clip_coef": diagnosis.expected_coef,
            "reported_norm": first.reported_norm,
            "local_norm": first.local_norm,
            "applied_clip_coef": first.applied_coef,
            "matched_norm": None
            if first.reported_match is None or first.reported_match.candidate is None
            else first.reported_match.candidate.value,
            "rtol": diagnosis.rtol,
        },
    )


def local_norm(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnosis_or_skip(step, m)
    if isinstance(diagnosis, Skip):
        return diagnosis
    ranks = _ranks_with(diagnosis, lambda h: h == LOCAL_ONLY)
    return (
        (_hit(diagnosis, ranks, "clipping used each rank's local norm, never reduced across ranks"),)
        if ranks
        else ()
    )


def double_counted(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnosis_or_skip(step, m)
    if isinstance(diagnosis, Skip):
        return diagnosis
    ranks = _ranks_with(diagnosis, lambda h: h == DOUBLE_COUNTED)
    return (
        (_hit(diagnosis, ranks, "clipping used a norm that counts every replica of replicated gradients"),)
        if ranks
        else ()
    )


def wrong_group(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnosis_or_skip(step, m)
    if isinstance(diagnosis, Skip):
        return diagnosis
    ranks = _ranks_with(diagnosis, lambda h: h.startswith(WRONG_GROUP + ":"))
    by_group: dict[str, list[RankDiagnosis]] = {}
    for d in ranks:
        by_group.setdefault(base_hypothesis(d.hypothesis)[0].split(":", 1)[1], []).append(d)
    hits = []
    for group, members in sorted(by_group.items()):
        hit = _hit(diagnosis, members, f"clipping reduced the norm over process group {group!r} only")
        hits.append(Hit(message=hit.message, ranks=hit.ranks, evidence={**hit.evidence, "group": group}))
    return tuple(hits)


def unexplained(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnosis_or_skip(step, m)
    if isinstance(diagnosis, Skip):
        return diagnosis
    ranks = _ranks_with(diagnosis, lambda h: h == UNEXPLAINED)
    if not ranks:
        return ()
    hit = _hit(diagnosis, ranks, "clipping used a norm that matches no known accounting mistake")
    candidates = ", ".join(f"{c.hypothesis} {num(c.value)}" for c in ranks[0].candidates)
    return (
        Hit(
            message=f"{hit.message}. Candidates tried for rank {ranks[0].rank}: {candidates}",
            ranks=hit.ranks,
            evidence=hit.evidence,
        ),
    )


def logging_bug(step: StepDump, m: StepMeasurements, options: AuditOptions) -> CheckResult:
    diagnosis = diagnosis_or_skip(step, m)
    if isinstance(diagnosis, Skip):
        return diagnosis
    ranks = [d for d in diagnosis.ranks.values() if d.logging_bug]
    if not ranks:
        return ()
    first = ranks[0]
    message = (
        f"wrong reported norm but right applied coefficient on {ranks_named(d.rank for d in ranks)}: "
        f"rank {first.rank} reported {num(first.reported_norm)} ({first.reported_match.hypothesis}) while the true "
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
                "reported_hypothesis": first.reported_match.hypothesis,
            },
        ),
    )


def is_correct(hypothesis: str | None) -> bool:
    return base_hypothesis(hypothesis)[0] == CORRECT
