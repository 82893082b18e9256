"""GA602-GA603: the sharded step against one unsharded reference step (`--reference`).

A parameter agrees with the reference when max |ours - reference| <= atol + rtol * max |reference|
(a normwise comparison: elements near zero do not blow up a relative error) and the two have
nonfinite values in the same places.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..analysis.norm_input import cover_norm
from ..analysis.tolerances import reference_tolerances, within_reference_tolerance
from ..model import TensorKind
from ..norms import expected_clip_coef, relative_difference
from ..report.model import ParamComparison
from ..steptable import ReferenceDifference, StepMeasurements
from .base import Analysis, AuditOptions, CheckResult, Hit, Skip, count, listing, num

if TYPE_CHECKING:
    from ..analysis.updates import UpdateJudgement

MAX_PARAMS_IN_MESSAGE = 5


def tolerances(dtype: str, options: AuditOptions) -> tuple[float, float]:
    return reference_tolerances(dtype, options.rtol, options.atol)


def compare(error: ReferenceDifference, options: AuditOptions) -> ParamComparison:
    rtol, atol = tolerances(error.dtype, options)
    rel = (
        error.max_abs_error / error.max_abs_reference
        if error.max_abs_reference > 0
        else (0.0 if error.max_abs_error == 0 else math.inf)
    )
    if error.num_nonfinite_mismatch:
        rel = math.inf
    return ParamComparison(
        param=error.param,
        kind=error.kind,
        max_abs_error=math.inf if error.num_nonfinite_mismatch else error.max_abs_error,
        max_rel_error=rel,
        atol=atol,
        rtol=rtol,
        within_tolerance=within_reference_tolerance(error, rtol, atol),
    )


def _badness(error: ReferenceDifference, options: AuditOptions) -> float:
    """The error as a multiple of what the tolerance allows."""
    if error.num_nonfinite_mismatch:
        return math.inf
    rtol, atol = tolerances(error.dtype, options)
    return error.max_abs_error / max(atol + rtol * error.max_abs_reference, 1e-300)


def reference_comparisons(m: StepMeasurements, options: AuditOptions) -> tuple[ParamComparison, ...]:
    """Every compared parameter and kind, worst first (outside tolerance first, then by error/tolerance)."""
    errors = [e for pm in m.params.values() for e in pm.reference_errors]
    errors.sort(key=lambda e: (-_badness(e, options), e.param, e.kind))
    found = [compare(e, options) for e in errors]
    return tuple(sorted(found, key=lambda c: c.within_tolerance))


def reference_norm(m: StepMeasurements) -> float | None:
    """The global norm of the reference's gradients."""
    table = m.reference_table
    if table is None or not table.size:
        return None
    return cover_norm(table, table.cover, table.grad, m.norm_type)


def _describe(c: ParamComparison) -> str:
    if math.isinf(c.max_abs_error):
        return f"{c.param} ({c.kind}): nonfinite values where the reference has none, or the other way round"
    return (
        f"{c.param} ({c.kind}): max |error| {num(c.max_abs_error)}, relative {num(c.max_rel_error)} "
        f"(allowed {num(c.atol)} + {num(c.rtol)} x max |reference|)"
    )


def _hits_for(
    kind: TensorKind,
    m: StepMeasurements,
    options: AuditOptions,
    lead: str,
    excused: frozenset[str] = frozenset(),
) -> list[Hit]:
    bad = [
        c
        for c in reference_comparisons(m, options)
        if c.kind == kind and not c.within_tolerance and c.param not in excused
    ]
    if not bad:
        return []
    lines = listing([_describe(c) for c in bad[:MAX_PARAMS_IN_MESSAGE]], len(bad))
    worst = bad[0]
    return [
        Hit(
            message=f"{lead} in {count(len(bad), 'parameter/tensor pair')}, worst first: " + lines,
            params=tuple(c.param for c in bad),
            evidence={
                "worst_param": worst.param,
                "worst_kind": worst.kind,
                "max_abs_error": worst.max_abs_error,
                "max_rel_error": worst.max_rel_error,
            },
        )
    ]


def gradients_differ(inputs: Analysis, options: AuditOptions) -> CheckResult:
    step, m = inputs.step, inputs.measurements
    if not m.reference_given:
        return Skip(reason="no unsharded reference was given (--reference REF)")
    compared = [e for pm in m.params.values() for e in pm.reference_errors if e.kind == "grad"]
    notes = [n for pm in m.params.values() for n in pm.notes]
    if not compared and not notes and not m.reference_only_params:
        return Skip(
            reason="neither dump holds gradient values of a common parameter (stats-only dumps cannot be compared)"
        )
    moment = (
        inputs.diagnosis.moment
    )  # when the dumped gradient was taken, when several clip calls make it matter
    lead = f"gradients ({moment})" if moment else "gradients"
    hits = _hits_for("grad", m, options, f"{lead} differ from the unsharded reference")
    if notes or m.reference_only_params:
        missing = notes + [f"{name}: only in the reference" for name in m.reference_only_params]
        hits.append(
            Hit(
                message="parameters that could not be compared with the reference: " + "; ".join(missing[:8]),
                params=tuple(
                    sorted({pm.param for pm in m.params.values() if pm.notes} | set(m.reference_only_params))
                ),
                evidence={"num_mismatched_params": len(missing)},
            )
        )
    ours = None if step.missing_ranks else inputs.diagnosis.true_norm
    theirs = reference_norm(m) if ours is not None and compared else None
    if ours is not None and theirs is not None:
        rtol = max(tolerances(e.dtype, options)[0] for e in compared)
        if relative_difference(ours, theirs) > rtol:
            max_norm = step.clip.max_norm if step.clip is not None else None
            coefs = ""
            if max_norm is not None:
                coefs = (
                    f"; expected coefficients {num(expected_clip_coef(ours, max_norm))} here and "
                    f"{num(expected_clip_coef(theirs, max_norm))} in the reference"
                )
            hits.append(
                Hit(
                    message=f"the global gradient norm is {num(ours)} here{' ' + moment if moment else ''} but "
                    f"{num(theirs)} in the reference{coefs}",
                    evidence={"global_norm": ours, "reference_global_norm": theirs, "rtol": rtol},
                )
            )
    return tuple(hits)


def clipped_or_next_weights_differ(inputs: Analysis, options: AuditOptions) -> CheckResult:
    m = inputs.measurements
    if not m.reference_given:
        return Skip(reason="no unsharded reference was given (--reference REF)")
    kinds = {e.kind for pm in m.params.values() for e in pm.reference_errors}
    if not kinds & {"grad_clipped", "param_after"}:
        return Skip(
            reason="the dump and the reference do not both hold post-clip gradients or next weights with values"
        )

    hits = _hits_for("grad_clipped", m, options, "clipped gradients differ from the unsharded reference")
    explained = frozenset(name for name, j in inputs.update_judgements.items() if j.explained)
    hits += _hits_for(
        "param_after", m, options, "the next weights differ from the unsharded reference", explained
    )
    return tuple(hits)


def updates_explained_by_optimizer(inputs: Analysis, options: AuditOptions) -> CheckResult:
    """GA604: next-weights differences that the optimizer's normalisation of agreeing gradients explains."""
    m = inputs.measurements
    if not m.reference_given:
        return Skip(reason="no unsharded reference was given (--reference REF)")

    explained = sorted((j for j in inputs.update_judgements.values() if j.explained), key=lambda j: j.param)
    if not explained:
        return ()
    lines = listing([_explained(j) for j in explained[:MAX_PARAMS_IN_MESSAGE]], len(explained))
    return (
        Hit(
            message=f"the next weights of {count(len(explained), 'parameter')} differ from the reference while "
            "their gradients agree; the optimizer's normalisation explains it (an adaptive optimizer turns "
            "near-zero gradients, whose sign is rounding noise, into full-size steps): " + lines,
            params=tuple(j.param for j in explained),
            evidence={
                "num_params": len(explained),
                "num_near_zero_gradient_elements": sum(j.num_near_zero_gradient for j in explained),
                "worst_param": max(explained, key=lambda j: j.max_abs_error).param,
            },
        ),
    )


def _explained(j: UpdateJudgement) -> str:
    why = (
        f"{count(j.num_near_zero_gradient, 'element')} with a gradient zero within tolerance "
        f"({num(j.gradient_tolerance)}), moved by up to the step size {num(j.max_update)}"
        if j.num_near_zero_gradient
        else "within what the reference's update makes of the gradient tolerance"
    )
    return f"{j.param}: max |error| {num(j.max_abs_error)} (allowed {num(j.base_tolerance)}): {why}"
