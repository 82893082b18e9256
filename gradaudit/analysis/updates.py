"""Next weights judged through the optimizer: is a next-weights difference from the reference what the
optimizer's own normalisation makes of gradient differences within tolerance?

An adaptive optimizer (Adam) divides each gradient element by its running magnitude, so a gradient
element that is zero up to rounding (a key bias behind a softmax, which is shift-invariant) moves its
weight by up to the full step size in a direction set by noise; the next weights then differ from the
reference although the gradients agree. For each element, the allowed next-weights error is the
reference's tolerance plus what the reference's own update makes of the allowed gradient error:
`|u_i| / |g_i| * allowed_g` (for SGD exactly lr * allowed_g), and for elements whose gradient is zero
within tolerance, up to twice the parameter's largest update element (the noise may flip the step).

`updates_to_judge` names the parameters whose gradients agree and whose next weights do not;
`measure.reference.dense_updates` reads their tensors; `judge_updates` and `judge_elements` are the
pure rule on those arrays.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..model import TensorKind
from .tolerances import reference_tolerances, within_reference_tolerance

if TYPE_CHECKING:
    from ..steptable import DenseUpdate, ParamMeasurement, ReferenceDifference, StepMeasurements


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


def updates_to_judge(
    m: StepMeasurements, reference_params: Collection[str], *, rtol: float | None, atol: float | None
) -> dict[str, TensorKind]:
    """Parameter -> the gradient kind to judge it by, for every parameter whose next weights are outside
    tolerance while its gradients agree (what `measure.reference.dense_updates` reads)."""
    return {
        name: found[1]
        for name, pm in m.params.items()
        if name in reference_params and (found := _errors_to_judge(pm, rtol, atol)) is not None
    }


def judge_updates(
    m: StepMeasurements, dense: Mapping[str, DenseUpdate], *, rtol: float | None, atol: float | None
) -> dict[str, UpdateJudgement]:
    """The judgement of every parameter `dense` holds the arrays of (pure)."""
    found: dict[str, UpdateJudgement] = {}
    for name, arrays in dense.items():
        judged = _errors_to_judge(m.params[name], rtol, atol)
        assert judged is not None  # dense holds only what updates_to_judge asked for
        after, _, grad = judged
        after_rtol, after_atol = reference_tolerances(after.dtype, rtol, atol)
        grad_rtol, grad_atol = reference_tolerances(grad.dtype, rtol, atol)
        found[name] = judge_elements(
            param=name,
            ours_after=arrays.ours_after,
            ref_before=arrays.ref_before,
            ref_after=arrays.ref_after,
            ref_grad=arrays.ref_grad,
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
