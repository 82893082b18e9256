"""Next weights judged through the optimizer: is a next-weights difference from the reference what the
optimizer's own normalisation makes of gradient differences within tolerance?

An adaptive optimizer (Adam) divides each gradient element by its running magnitude, so a gradient
element that is zero up to rounding (a key bias behind a softmax, which is shift-invariant) moves its
weight by up to the full step size in a direction set by noise; the next weights then differ from the
reference although the gradients agree. For each element, the allowed next-weights error is the
reference's tolerance plus what the reference's own update makes of the allowed gradient error:
`|u_i| / |g_i| * allowed_g` (for SGD exactly lr * allowed_g), and for elements whose gradient is zero
within tolerance, up to twice the parameter's largest update element (the noise may flip the step).

`explain_update_errors` reads tensors (the shell side, only for parameters whose gradients agree and
whose next weights do not); `judge_elements` is the pure rule on tensors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..model import StepDump, TensorKind
from .tolerances import reference_tolerances, within_reference_tolerance

if TYPE_CHECKING:
    from ..dumpfile import TensorReader
    from ..steptable import ParamMeasurement, ReferenceDifference, StepMeasurements


@dataclass(frozen=True, kw_only=True)
class UpdateJudgement:
    """One parameter's next weights judged through the optimizer's normalisation."""

    param: str
    explained: bool
    max_abs_error: float
    base_tolerance: float
    """atol + rtol * max |reference next weights|: what GA603 allowed."""
    num_near_zero_gradient: int
    """Elements whose error needed the near-zero-gradient allowance (their gradient is zero within tolerance)."""
    gradient_tolerance: float
    max_update: float
    """The largest |update| element of the reference step for this parameter."""


def judge_elements(
    *,
    param: str,
    ours_after: np.ndarray,
    ref_before: np.ndarray,
    ref_after: np.ndarray,
    ref_grad: np.ndarray,
    base_tolerance: float,
    gradient_tolerance: float,
) -> UpdateJudgement:
    """The rule above on float64 arrays of one parameter (same shapes)."""
    with np.errstate(invalid="ignore", over="ignore"):
        error = np.abs(ours_after - ref_after)
        update = np.abs(ref_after - ref_before)
        grad = np.abs(ref_grad)
        max_update = float(update.max()) if update.size else 0.0
        near_zero = grad <= gradient_tolerance
        sensitivity = np.where(near_zero, 0.0, update / np.maximum(grad, 1e-300))
        allowed = base_tolerance + np.where(near_zero, 2 * max_update, sensitivity * gradient_tolerance)
    finite = np.isfinite(error)
    explained = bool(finite.all()) and bool((error <= allowed).all())
    needed = (error > base_tolerance + sensitivity * gradient_tolerance) & near_zero
    return UpdateJudgement(
        param=param,
        explained=explained,
        max_abs_error=float(error.max()) if error.size else 0.0,
        base_tolerance=base_tolerance,
        num_near_zero_gradient=int(needed.sum()),
        gradient_tolerance=gradient_tolerance,
        max_update=max_update,
    )


def explain_update_errors(
    step: StepDump,
    reference: StepDump,
    m: StepMeasurements,
    reader: TensorReader,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> Mapping[str, UpdateJudgement]:
    """Judge every parameter whose next weights are outside tolerance while its gradients agree."""
    from ..measure.reference import assemble_dense
    from ..measure.table import piece_table

    judged = {
        name: errors
        for name, errors in ((name, _errors_to_judge(pm, rtol, atol)) for name, pm in m.params.items())
        if errors is not None and name in reference.params
    }
    if not judged:
        return {}
    ref_table, our_table = piece_table(reference, judged), piece_table(step, judged)
    found: dict[str, UpdateJudgement] = {}
    for name, (after, grad_kind, grad) in judged.items():
        shape = tuple(reference.params[name].global_shape)
        ref_pieces = [(path, piece) for _, path, piece in ref_table.cover(name)]
        ours = [(path, piece) for _, path, piece in our_table.cover(name)]
        needed: tuple[TensorKind, ...] = ("param_before", "param_after", grad_kind)
        if not all(all(k in p.tensors for _, p in ref_pieces) and ref_pieces for k in needed):
            continue
        if not ours or not all("param_after" in p.tensors for _, p in ours):
            continue
        dense = {k: assemble_dense(reader, shape, ref_pieces, k) for k in needed}
        ours_after = assemble_dense(reader, shape, ours, "param_after")
        if bool(np.isnan(ours_after).any()) and not bool(np.isnan(dense["param_after"]).any()):
            continue  # our pieces do not cover the parameter: leave it to GA603
        after_rtol, after_atol = reference_tolerances(after.dtype, rtol, atol)
        grad_rtol, grad_atol = reference_tolerances(grad.dtype, rtol, atol)
        found[name] = judge_elements(
            param=name,
            ours_after=ours_after,
            ref_before=dense["param_before"],
            ref_after=dense["param_after"],
            ref_grad=dense[grad_kind] / _scale(reference, grad_kind),
            base_tolerance=after_atol + after_rtol * after.max_abs_reference,
            gradient_tolerance=grad_atol + grad_rtol * grad.max_abs_reference,
        )
    return found


def _errors_to_judge(
    pm: ParamMeasurement, rtol: float | None, atol: float | None
) -> tuple[ReferenceDifference, TensorKind, ReferenceDifference] | None:
    """(next weights' error, gradient kind, its error) when the next weights alone are outside tolerance."""
    by_kind = {e.kind: e for e in pm.reference_errors}
    after = by_kind.get("param_after")
    grad_kind: TensorKind = "grad_clipped" if "grad_clipped" in by_kind else "grad"
    grad = by_kind.get(grad_kind)
    if after is None or grad is None or _within(after, rtol, atol):
        return None
    if not all(_within(e, rtol, atol) for k, e in by_kind.items() if k != "param_after"):
        return None
    return after, grad_kind, grad


def _within(error: ReferenceDifference, rtol: float | None, atol: float | None) -> bool:
    return within_reference_tolerance(error, *reference_tolerances(error.dtype, rtol, atol))


def _scale(step: StepDump, kind: str) -> float:
    from ..measure.measurements import SCALED_KINDS, dumped_gradient_scale

    if kind not in SCALED_KINDS or not step.ranks_present:
        return 1.0
    scale = dumped_gradient_scale(step.ranks[step.ranks_present[0]])
    return scale if math.isfinite(scale) and scale > 0 else 1.0
