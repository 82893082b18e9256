"""The norm math, on float64 partial sums: pure functions, no torch."""

from __future__ import annotations

import math
from collections.abc import Iterable

CLIP_EPS = 1e-6
"""The epsilon of torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6)."""


def norm_name(norm_type: float | None) -> str:
    """ "L2 norm", "L1 norm", "Linf norm"; "norm" when unknown: how every report names the norm."""
    if norm_type is None:
        return "norm"
    return f"L{norm_type:.6g} norm"


def is_inf_norm(norm_type: float) -> bool:
    return math.isinf(norm_type)


def check_norm_type(norm_type: object) -> float:
    """`norm_type` as a float when it is one gradaudit audits, else ValueError saying why: the one
    rule for the writer and the reader, torch's own (clip_grad_norm_ takes any p > 0, or inf; the
    string "inf" as well). A p so small that the norm overflows float64 is audited all the same:
    its norm is inf, as in torch."""
    if isinstance(norm_type, bool):
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    try:
        value = float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}") from None
    if not value > 0:
        raise ValueError(f"norm_type must be a positive number or 'inf', got {norm_type!r}")
    return value


def safe_fsum(values: Iterable[float]) -> float:
    """math.fsum, but inf (or nan) instead of OverflowError/ValueError when the exact sum of finite
    values is beyond float64 or the values hold infinities of both signs."""
    values = list(values)
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf if sum(1 for v in values if v > 0) >= sum(1 for v in values if v < 0) else -math.inf
    except ValueError:
        return math.nan


def combine_terms(terms: Iterable[float], norm_type: float) -> float:
    """Combine per-piece terms (sum |x|^p, or max |x| for the inf norm) of a disjoint cover; inf
    when the sum exceeds float64 (norm_of_terms still finds a finite norm then)."""
    terms = list(terms)
    if is_inf_norm(norm_type):
        return max(terms, default=0.0)
    return safe_fsum(terms)


def norm_from_total(total: float, norm_type: float) -> float:
    """The p-norm from the combined term: total^(1/p), or total itself for the inf norm; inf when
    that overflows float64."""
    if is_inf_norm(norm_type) or math.isnan(total) or math.isinf(total):
        return total
    if norm_type == 1.0:
        return total
    if norm_type == 2.0:
        return math.sqrt(total)
    return power(total, 1.0 / norm_type)


def power(base: float, exponent: float) -> float:
    """base ** exponent for base >= 0, inf on overflow and 0 on underflow instead of an exception."""
    try:
        return float(base**exponent)
    except OverflowError:
        return math.inf


def norm_of_terms(terms: Iterable[float], norm_type: float) -> float:
    """The p-norm of a disjoint cover from its per-piece terms.

    When the plain sum of the terms overflows float64 but every term is finite, the largest term M
    is factored out: norm = M^(1/p) * (sum t/M)^(1/p), finite whenever the norm itself is."""
    terms = list(terms)
    total = combine_terms(terms, norm_type)
    if math.isinf(total) and total > 0 and not is_inf_norm(norm_type) and all(map(math.isfinite, terms)):
        largest = max(terms)
        scaled = math.fsum(t / largest for t in terms)
        return norm_from_total(largest, norm_type) * norm_from_total(scaled, norm_type)
    return norm_from_total(total, norm_type)


def divide_by_power(value: float, scale: float, exponent: float) -> float:
    """value / scale**exponent for scale > 0, without overflow or division by zero in between:
    the result is inf or 0 only when it is beyond float64 itself."""
    try:
        divisor = float(scale**exponent)
        if divisor != 0.0 and math.isfinite(divisor):
            return value / divisor
    except OverflowError:
        pass
    if value == 0.0 or not math.isfinite(value):
        return value
    log = math.log(abs(value)) - exponent * math.log(scale)
    magnitude = math.inf if log > 709.78 else math.exp(log)
    return math.copysign(magnitude, value)


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
