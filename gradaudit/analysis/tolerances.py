"""How far the sharded step may differ from an unsharded reference, by dumped dtype."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..steptable import ReferenceDifference

REFERENCE_TOLERANCE_BY_DTYPE = {
    "float64": (1e-9, 1e-12),
    "float32": (1e-4, 1e-8),
    "float16": (5e-3, 1e-5),
    "bfloat16": (2e-2, 1e-5),
    "float8_e4m3fn": (1e-1, 1e-3),
    "float8_e5m2": (2e-1, 1e-3),
}
"""(rtol, atol) by the dumped dtype: a sharded run sums in another order than the unsharded one."""


def reference_tolerances(dtype: str, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """(rtol, atol) for values of `dtype`; the user's `--rtol`/`--atol` replace the defaults."""
    default_rtol, default_atol = REFERENCE_TOLERANCE_BY_DTYPE.get(
        dtype, REFERENCE_TOLERANCE_BY_DTYPE["float32"]
    )
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def within_reference_tolerance(error: ReferenceDifference, rtol: float, atol: float) -> bool:
    """max |ours - reference| <= atol + rtol * max |reference|, with nonfinite values in the same places."""
    return error.num_nonfinite_mismatch == 0 and error.max_abs_error <= atol + rtol * error.max_abs_reference
