"""GA100-GA104: is the step complete and consistent, and does every element have exactly one owner
(the ownership coverage itself is analysis.coverage's)?"""

from __future__ import annotations

from ..errors import clipped
from ..model import ParamInfo
from .base import (
    MAX_FINDINGS_PER_CODE,
    Analysis,
    AuditOptions,
    CheckResult,
    Hit,
    Skip,
    first_names,
    ranks_named,
)


def missing_ranks(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    if not step.missing_ranks:
        return ()
    return (
        Hit(
            message=(
                f"{len(step.missing_ranks)} of {step.world_size} ranks have no file in {step.directory} "
                f"({ranks_named(step.missing_ranks)}); the other ranks are audited and the checks that "
                "need the missing ranks say they could not decide"
                + "".join(
                    f"; rank {rank}'s file is unreadable: {reason}"
                    for rank, reason in sorted(step.unreadable_ranks.items())
                )
            ),
            ranks=step.missing_ranks,
            evidence={"world_size": step.world_size, "num_missing": len(step.missing_ranks)},
        ),
    )


def metadata_disagreement(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    hits = []
    for item in step.inconsistencies:
        by_value: dict[str, list[int]] = {}
        for rank, value in sorted(item.values.items()):
            by_value.setdefault(value, []).append(rank)
        described = "; ".join(
            f"{ranks_named(r)}: {v}" for v, r in sorted(by_value.items(), key=lambda kv: kv[1])
        )
        hits.append(
            Hit(
                message=f"ranks disagree on {item.what}: {described}",
                ranks=tuple(item.values),
                evidence={"what": item.what, "num_values": len(by_value)},
            )
        )
    return tuple(hits)


def ownership_overlap(inputs: Analysis, options: AuditOptions) -> CheckResult:
    return tuple(
        Hit(
            message=(
                f"{result.num_overlap_elements} of {info.numel} elements of {name} are held by more than "
                f"one piece that is not an identical replica ({ranks_named(ranks)}); those "
                "elements would be counted twice in any norm"
            ),
            ranks=tuple(ranks),
            params=(name,),
            evidence={"num_overlap_elements": result.num_overlap_elements, "numel": info.numel},
        )
        for name, (info, result, ranks, _) in inputs.coverage.items()
        if result.num_overlap_elements
    )


def ownership_gap(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    if step.missing_ranks:
        return Skip(
            reason=f"some ranks are missing ({ranks_named(step.missing_ranks)}); "
            "the elements they held cannot be located"
        )
    gaps = {name: found for name, found in inputs.coverage.items() if found.coverage.num_gap_elements}
    # Past MAX_FINDINGS_PER_CODE, one finding for the parameters no rank holds any of, not one each: a
    # table may list 10^6.
    fold = len(gaps) > MAX_FINDINGS_PER_CODE
    hits = tuple(
        Hit(
            message=(
                f"{found.coverage.num_gap_elements} of {found.info.numel} elements of {name} are held by no "
                f"rank (held pieces are on {ranks_named(found.holders)}); their gradient is absent from every norm"
            ),
            ranks=tuple(found.holders),
            params=(name,),
            evidence={"num_gap_elements": found.coverage.num_gap_elements, "numel": found.info.numel},
        )
        for name, found in gaps.items()
        if found.holders or not fold
    )
    if fold:
        return (*hits, _unheld_params([f.info for f in gaps.values() if not f.holders], len(step.params)))
    return hits


def _unheld_params(unheld: list[ParamInfo], num_params: int) -> Hit:
    names = sorted(info.name for info in unheld)
    listed, text = first_names(names)
    numel = sum(info.numel for info in unheld)
    return Hit(
        message=(
            f"{len(unheld)} of the step's {num_params} parameters are held by no rank at all "
            f"({text}; {numel} elements); their gradients are absent from every norm"
        ),
        params=listed,
        evidence={"num_params": len(unheld), "num_gap_elements": numel, "numel": numel},
    )


def parameters_not_captured(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    left_out: dict[str, tuple[str, list[int]]] = {}
    for rank in step.ranks_present:
        for param in step.ranks[rank].not_captured:
            left_out.setdefault(param.name, (param.reason, []))[1].append(rank)
    if not left_out:
        return ()
    named = "; ".join(
        f"{name} on {ranks_named(ranks)}: {clipped(reason)}"
        for name, (reason, ranks) in sorted(left_out.items())[:10]
    )
    more = f" (and {len(left_out) - 10} more)" if len(left_out) > 10 else ""
    return Skip(
        reason=f"{len(left_out)} parameter(s) were not captured, so every norm here leaves them out: {named}{more}"
    )
