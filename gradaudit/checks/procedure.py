"""GA501, GA502, GA702: how clipping was scheduled, whether it saw scaled gradients, how losses were averaged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, num, ranks_named

if TYPE_CHECKING:
    from ..analysis.diagnosis import CallNorm

MAX_CALLS_IN_MESSAGE = 8


def clipped_more_than_once(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step

    calls = {r: clip.calls for r in step.ranks_present if (clip := step.ranks[r].clip) is not None}
    if not any(calls.values()):
        return Skip(reason="no rank recorded its individual clip calls")
    repeated = {r: c for r, c in calls.items() if len(c) > 1}
    if not repeated:
        return ()
    first_rank = min(repeated)
    norms = ", ".join(num(c.reported_norm) for c in repeated[first_rank][:MAX_CALLS_IN_MESSAGE])
    counts = sorted({len(c) for c in repeated.values()})
    evidence: dict[str, int | float | str | None] = {
        "num_calls": max(counts),
        "first_rank": first_rank,
        "call_1_reported_norm": repeated[first_rank][0].reported_norm,
    }
    diagnosis = inputs.diagnosis
    if diagnosis.call_norms:
        true_norms = _call_norms_text(diagnosis.call_norms[:MAX_CALLS_IN_MESSAGE], diagnosis.max_norm)
        evidence.update(
            {f"call_{c.call}_true_norm": c.norm for c in diagnosis.call_norms[:MAX_CALLS_IN_MESSAGE]}
        )
        truth = f"; the true global norm was {true_norms}"
    else:
        truth = (
            "; the dump holds the gradient from before the first call only (no per-call statistics), so "
            "the true norm at each call is unknown and no coefficient or replica check is derived from it"
        )
    from ..analysis.param_coefs import PER_CALL

    per_group = inputs.param_coefficients is not None and inputs.param_coefficients.cause == PER_CALL
    advice = (
        "each call scaled only its own parameters by its own norm (one call per param group, see GA304): "
        "clip once, by the norm of all of them"
        if per_group
        else "clipping each microbatch's partial gradient is not clipping the accumulated gradient: clip "
        "once, after the last microbatch"
    )
    return (
        Hit(
            message=(
                f"{ranks_named(repeated)} clipped {'/'.join(map(str, counts))} times before one optimizer step "
                f"(rank {first_rank} reported norms {norms}){truth}; {advice}"
            ),
            ranks=tuple(repeated),
            evidence=evidence,
        ),
    )


def _call_norms_text(call_norms: Sequence[CallNorm], max_norm: float | None) -> str:
    parts = []
    for c in call_norms:
        text = f"{num(c.norm)} before call {c.call}"
        if c.replicas_differ:
            text += " (replicas not yet reduced: the lowest rank's copies counted)"
        elif max_norm is not None and c.norm is not None and c.norm <= max_norm:
            text += " (at most max_norm: that call scaled nothing)"
        parts.append(text)
    return ", ".join(parts)


def clipped_scaled_gradients(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    from ..analysis.diagnosis import loss_scale_of

    scale = loss_scale_of(step)
    if scale is None:
        return Skip(reason="no loss scale was recorded (no GradScaler in this run, or not captured)")
    flagged: dict[int, str] = {}
    for rank in step.ranks_present:
        clip = step.ranks[rank].clip
        if clip is None:
            continue
        if clip.unscaled_before_clip is False or any(c.unscaled is False for c in clip.calls):
            flagged[rank] = "its record says GradScaler.unscale_ had not run"
    if step.clip is not None:
        for rank, d in inputs.diagnosis.ranks.items():
            if d.hypothesis is not None and d.hypothesis.loss_scaled and not d.logging_bug:
                flagged.setdefault(rank, f"its norm matches the loss-scaled one ({d.detail})")
    if not flagged:
        return ()
    max_norm = step.clip.max_norm if step.clip is not None else None
    first = min(flagged)
    threshold = ""
    if max_norm is not None:
        threshold = (
            f"; clipping gradients scaled by {num(scale)} at max_norm {num(max_norm)} clips the true gradients at "
            f"{num(max_norm / scale)}"
        )
    return (
        Hit(
            message=(
                f"{ranks_named(flagged)} clipped gradients still multiplied by the loss scale {num(scale)}: "
                f"rank {first}: {flagged[first]}{threshold}"
            ),
            ranks=tuple(flagged),
            evidence={
                "loss_scale": scale,
                "max_norm": max_norm,
                "effective_max_norm": None if max_norm is None else max_norm / scale,
            },
        ),
    )


def uneven_token_means(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step = inputs.step
    records = {r: step.ranks[r].data for r in step.ranks_present if step.ranks[r].data.tokens is not None}
    if len(records) < 2:
        return Skip(reason="fewer than two ranks recorded their token counts")
    means = {r: d.tokens for r, d in records.items() if d.loss_reduction == "mean" and d.tokens is not None}
    if len(set(means.values())) <= 1:
        return ()
    low, high = min(means.values()), max(means.values())
    listed = ", ".join(f"rank {r}: {t}" for r, t in sorted(means.items())[:8])
    return (
        Hit(
            message=(
                f"{ranks_named(means)} each averaged their own loss over different token counts ({listed}); "
                "averaging those means weights a token of the smallest batch "
                f"{num(high / low if low else float('inf'))} times more than one of the largest"
            ),
            ranks=tuple(r for r, t in means.items() if t != high) if low != high else tuple(means),
            evidence={"min_tokens": low, "max_tokens": high},
        ),
    )
