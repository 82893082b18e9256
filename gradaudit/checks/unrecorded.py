"""GA504, GA505: clipping the audit did not see: gradients clipped before the recorded call, or no clip call
at all although max_norm was declared."""

from __future__ import annotations

import math

from .base import Analysis, AuditOptions, CheckResult, Hit, num, ranks_named


def clipped_before_the_recorded_call(inputs: Analysis, options: AuditOptions) -> CheckResult:
    """One recorded clip call per rank, whose gradients' true global norm is max_norm itself (to the
    rounding of their dtype: what a clip leaves behind) and which then scaled nothing.

    Every clip call made through a known function is recorded (capture/intercept.py), so this is a
    clip of the training code's own, or one imported from a framework gradaudit does not know. With
    two or more recorded calls the earlier ones explain such gradients (GA501 reports them)."""
    step = inputs.step
    clips = {r: c for r in step.ranks_present if (c := step.ranks[r].clip) is not None}
    if not any(c.calls for c in clips.values()):
        return ()  # GA503 checks dumps taken after clipping
    if any(len(c.calls) > 1 for c in clips.values()):
        return ()  # the earlier recorded calls clipped these gradients (GA501)
    diagnosis = inputs.diagnosis
    max_norm, true_norm = diagnosis.max_norm, diagnosis.true_norm
    if max_norm is None or not _is(true_norm, max_norm, diagnosis.rtol):
        return ()  # not max_norm, or unknown or nonfinite: GA206 and GA401 say why clipping was not checked
    idle = {r: d.applied_coef for r, d in diagnosis.ranks.items() if _is(d.applied_coef, 1.0, diagnosis.rtol)}
    if len(idle) < len(diagnosis.ranks) and any(d.applied_coef is not None for d in diagnosis.ranks.values()):
        return ()  # the recorded call scaled the gradients: it clipped them itself
    ranks = tuple(sorted(idle or diagnosis.ranks))
    coef = num(idle[ranks[0]]) if idle else "1, by the norm they reported"
    return (
        Hit(
            message=(
                f"the gradients the recorded clip call saw had global norm {num(true_norm)}, max_norm {num(max_norm)} "
                f"itself, and the call then scaled nothing ({ranks_named(ranks)} applied coefficient {coef}): they "
                "were clipped before the recorded call, by a clip the audit did not see, so the norm that clip "
                "used and its coefficient are not checked. Clip once, through audit.clip or a function gradaudit "
                "records (torch.nn.utils.clip_grad_norm_, the framework's own)"
            ),
            ranks=ranks,
            evidence={"true_norm": true_norm, "max_norm": max_norm, "rtol": diagnosis.rtol},
        ),
    )


def no_clip_call(inputs: Analysis, options: AuditOptions) -> CheckResult:
    """max_norm declared, the optimizer step observed, and no rank recorded a clip call, a norm or a
    coefficient: the gradients the step used were clipped by nothing the audit saw.

    Every clip call made through a known function while the audit was open is recorded, so either
    the training code never clipped or it clipped by hand without recording what it did
    (`audit.record(reported_norm=..., clip_coef=...)`, which this check then leaves to the others)."""
    step = inputs.step
    clips = {r: c for r in step.ranks_present if (c := step.ranks[r].clip) is not None}
    if not clips or any(
        c.calls or c.reported_norm is not None or c.clip_coef is not None for c in clips.values()
    ):
        return ()
    stepped = tuple(r for r, c in clips.items() if c.step_skipped is False)
    diagnosis = inputs.diagnosis
    max_norm, true_norm = diagnosis.max_norm, diagnosis.true_norm
    if not stepped or max_norm is None or true_norm is None or not math.isfinite(true_norm):
        return ()  # a dump() before the clip, or a skipped step: nothing says the step went unclipped
    if _is(true_norm, max_norm, diagnosis.rtol):
        return ()  # what a clip leaves behind: GA503 (captured after clipping)
    above = true_norm > max_norm
    consequence = (
        f"so the step was not clipped: the expected coefficient was {num(diagnosis.expected_coef)}"
        if above
        else "below max_norm, so this step was unaffected, but nothing would clip a larger one"
    )
    local_norms = [d.local_norm for d in diagnosis.ranks.values()]
    if above and len(local_norms) > 1 and all(_is(n, max_norm, diagnosis.rtol) for n in local_norms):
        message = (
            f"no clip call was recorded although max_norm {num(max_norm)} was declared, yet every rank's own "
            "gradient norm is max_norm: the fingerprint of a hand-written clip of each rank's own shards by its "
            f"local norm. {ranks_named(stepped).capitalize()} stepped the optimizer with gradients of global norm "
            f"{num(true_norm)}, the norm after that clip (the one before it is unknown). Clip by the global norm "
            "(torch.nn.utils.clip_grad_norm_ over the model's parameters), and route a clip of your own through "
            "guard.clip(fn, ...) or audit.clip(fn, ...) so that it is measured"
        )
        return (
            Hit(message=message, ranks=stepped, evidence={"norm_at_step": true_norm, "max_norm": max_norm}),
        )
    return (
        Hit(
            message=(
                f"no clip ran although max_norm {num(max_norm)} was declared: {ranks_named(stepped)} stepped the "
                f"optimizer with gradients of true global norm {num(true_norm)} and recorded no clip call, norm "
                f"or coefficient, {consequence}. Clip after the last backward (torch.nn.utils.clip_grad_norm_ or "
                "the stack's own clip); a hand-written clip records its norm with audit.record(reported_norm=...)"
            ),
            ranks=stepped,
            evidence={"true_norm": true_norm, "max_norm": max_norm, "expected_coef": diagnosis.expected_coef},
        ),
    )


def _is(value: float | None, target: float, rtol: float) -> bool:
    return value is not None and abs(value - target) <= rtol * target
