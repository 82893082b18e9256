"""The norm math, on float64 partial sums: pure functions, no torch."""

from __future__ import annotations

import math
from collections.abc import Iterable

CLIP_EPS = 1e-6
"""The epsilon of torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)."""


def is_inf_norm(norm_type: float) -> bool:
    return math.isinf(norm_type)


def combine_terms(terms: Iterable[float], norm_type: float) -> float:
    """Combine per-piece terms (sum |x|^p, or max |x| for the inf norm) of a disjoint cover."""
    terms = list(terms)
    if is_inf_norm(norm_type):
        return max(terms, default=0.0)
    return math.fsum(terms)


def norm_from_total(total: float, norm_type: float) -> float:
    """The p-norm from the combined term: total^(1/p), or total itself for the inf norm."""
    if is_inf_norm(norm_type) or math.isnan(total) or math.isinf(total):
        return total
    if norm_type == 1.0:
        return total
    if norm_type == 2.0:
        return math.sqrt(total)
    return total ** (1.0 / norm_type)


def norm_of_terms(terms: Iterable[float], norm_type: float) -> float:
    return norm_from_total(combine_terms(terms, norm_type), norm_type)


def expected_clip_coef(norm: float, max_norm: float) -> float:
    """min(1, max_norm / (norm + 1e-6)): the coefficient torch.nn.utils.clip_grad_norm_ applies."""
    if math.isnan(norm):
        return math.nan
    return min(1.0, max_norm / (norm + CLIP_EPS))


def relative_difference(a: float, b: float) -> float:
    """|a - b| / max(|a|, |b|), 0 when both are 0; nan compares equal only to nan."""
    if math.isnan(a) or math.isnan(b):
        return 0.0 if (math.isnan(a) and math.isnan(b)) else math.inf
    if a == b:
        return 0.0
    scale = max(abs(a), abs(b))
    if math.isinf(scale):
        return math.inf
    return abs(a - b) / scale


NORM_RTOL_BY_DTYPE = {
    "float64": 1e-9,
    "float32": 1e-4,
    "bfloat16": 2e-2,
    "float16": 5e-3,
    "float8_e4m3fn": 1e-1,
    "float8_e5m2": 2e-1,
}
"""How closely a norm the training code computed (possibly in the gradient's dtype) can match ours."""


def norm_rtol(dtypes: Iterable[str]) -> float:
    """The loosest tolerance among the dtypes involved; float32 when none is known."""
    return max((NORM_RTOL_BY_DTYPE.get(d, 1e-4) for d in dtypes), default=NORM_RTOL_BY_DTYPE["float32"])
