"""The norm math, on float64 partial sums: pure functions, no torch."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Union, overload

if TYPE_CHECKING:
    import numpy as np

    from .model import TensorStats

Terms = Union[Iterable[float], "np.ndarray"]
"""Floats, as any iterable or as a float64 array (summed chunk by chunk, never a Python float per
value held at once): every function below takes either, with one implementation."""

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


def safe_fsum(values: Terms) -> float:
    """math.fsum, but inf (or nan) instead of OverflowError/ValueError when the exact sum of finite
    values is beyond float64 or the values hold infinities of both signs."""
    values = _held(values)
    try:
        return math.fsum(_floats(values))
    except OverflowError:
        return math.inf if _count(values, 1) >= _count(values, -1) else -math.inf
    except ValueError:
        return math.nan


_CHUNK = 1 << 16


def segment_fsums(values: np.ndarray, starts: Sequence[int]) -> tuple[list[float], float]:
    """(safe_fsum of each segment of the float64 array `values`, safe_fsum of all of it), bit for
    bit, without a Python float per value. Segment k runs from starts[k] (ascending, the first 0) to
    the next start, the last to the end.

    Each value is an integer mantissa times a power of two; its two halves (27 bits each) are added
    per segment and exponent in float64, exactly (integers below 2^53), carried into one bit per power
    of two (int64), and each segment's bits become one Python int: its exact sum, rounded once by the
    int division (correctly, as math.fsum rounds); the total is the sum of those ints. Values that are
    nonfinite or so large that math.fsum could overflow on the way, and zero sums (math.fsum's sign),
    go through safe_fsum itself."""
    import numpy as np

    bounds = [*starts, values.size]
    if not (
        values.size < 1 << 25
        and np.isfinite(values).all()
        and float(np.abs(values).max(initial=0.0)) * values.size < 2.0**1000
    ):
        return [safe_fsum(values[a:b]) for a, b in itertools.pairwise(bounds)], safe_fsum(values)
    found: list[float] = []
    total, total_shift = 0, 0
    first = 0
    while first < len(starts):  # a chunk of whole segments of about 2^20 values: small temporaries
        last = first + 1
        while last < len(starts) and bounds[last + 1] - bounds[first] <= 1 << 20:
            last += 1
        exact, shift = _exact_sums(
            values[bounds[first] : bounds[last]], np.subtract(bounds[first : last + 1], bounds[first])
        )
        for k, value in enumerate(exact):
            if value == 0:
                found.append(safe_fsum(values[bounds[first + k] : bounds[first + k + 1]]))
            else:
                found.append(value / (1 << -shift) if shift < 0 else float(value << shift))
        chunk = sum(exact)
        if total == 0 or shift < total_shift:
            total, total_shift = (total << (total_shift - shift)) + chunk, shift
        else:
            total += chunk << (shift - total_shift)
        first = last
    if total == 0:
        return found, safe_fsum(values)
    return found, total / (1 << -total_shift) if total_shift < 0 else float(total << total_shift)


def _exact_sums(values: np.ndarray, bounds: np.ndarray) -> tuple[list[int], int]:
    """([exact sum of values[bounds[k]:bounds[k+1]] as an int], shift): sum k is int k * 2^shift."""
    import numpy as np

    mantissa, exponent = np.frexp(values)
    whole = mantissa * 2.0**53  # an integer of at most 53 bits: value = whole * 2^(exponent - 53)
    high = np.floor(whole * 2.0**-27)
    low = whole - high * 2.0**27  # 0 <= low < 2^27, |high| <= 2^26
    lowest = int(exponent.min(initial=0))
    span = int(exponent.max(initial=0)) - lowest + 28  # high's bits sit 27 places up
    count = bounds.size - 1
    at = np.repeat(np.arange(count) * span - lowest, np.diff(bounds)) + exponent
    digits = np.bincount(at, weights=low, minlength=count * span)
    digits += np.bincount(at + 27, weights=high, minlength=count * span)
    rows = digits.astype(np.int64).reshape(count, span)  # sums of fewer than 2^25 halves: below 2^53
    bits = np.empty((count, span), dtype=np.uint8)
    carry = np.zeros(count, dtype=np.int64)
    for e in range(span):
        carried = rows[:, e] + carry
        bits[:, e], carry = carried & 1, carried >> 1
    packed = np.packbits(bits, axis=1, bitorder="little")
    tops = carry.tolist()
    return [
        int.from_bytes(packed[k].tobytes(), "little") + (tops[k] << span) for k in range(count)
    ], lowest - 53


def _held(values: Terms) -> list[float] | np.ndarray:
    return values if hasattr(values, "dtype") else list(values)  # type: ignore[return-value]


def _floats(values: list[float] | np.ndarray) -> Iterable[float]:
    if isinstance(values, list):
        return values
    return itertools.chain.from_iterable(
        values[i : i + _CHUNK].tolist() for i in range(0, values.size, _CHUNK)
    )


def _count(values: list[float] | np.ndarray, sign: int) -> int:
    """How many values have this sign."""
    if isinstance(values, list):
        return sum(1 for v in values if v * sign > 0)
    return int((values * sign > 0).sum())


def _largest(values: list[float] | np.ndarray) -> float:
    if isinstance(values, list):
        return max(values, default=0.0)
    return float(values.max()) if values.size else 0.0


def combine_terms(terms: Terms, norm_type: float) -> float:
    """Combine per-piece terms (sum |x|^p, or max |x| for the inf norm) of a disjoint cover; inf
    when the sum exceeds float64 (norm_of_terms still finds a finite norm then)."""
    terms = _held(terms)
    if is_inf_norm(norm_type):
        return _largest(terms)
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


def norm_of_terms(terms: Terms, norm_type: float) -> float:
    """The p-norm of a disjoint cover from its per-piece terms.

    When the plain sum of the terms overflows float64 but every term is finite, the largest term M
    is factored out: norm = M^(1/p) * (sum t/M)^(1/p), finite whenever the norm itself is."""
    terms = _held(terms)
    total = combine_terms(terms, norm_type)
    if (
        math.isinf(total)
        and total > 0
        and not is_inf_norm(norm_type)
        and all(map(math.isfinite, _floats(terms)))
    ):
        largest = _largest(terms)
        scaled = safe_fsum([t / largest for t in terms] if isinstance(terms, list) else terms / largest)
        return norm_from_total(largest, norm_type) * norm_from_total(scaled, norm_type)
    return norm_from_total(total, norm_type)


UNKNOWN, NAN, INF = 1, 2, 4
"""Bits of a term's flags: the statistics cannot give this norm type's term, a nan, an infinity."""


def term_of(stats: TensorStats, norm_type: float, scale: float = 1.0) -> float | None:
    """The term of the p-norm of a piece's statistics (sum |x|^p, or max |x| for the inf-norm),
    divided by `scale`'s effect; None when the stats were taken for another norm type."""
    column = term_column(stats.norm_type, norm_type)
    if column is None:
        return None
    term = (stats.sum_pow, stats.sum_sq, stats.max_abs)[column]
    if scale == 1.0:
        return term
    return term / scale if is_inf_norm(norm_type) else divide_by_power(term, scale, norm_type)


def term_column(stats_norm_type: float, norm_type: float) -> int | None:
    """Which of (sum_pow, sum_sq, max_abs), taken for `stats_norm_type`, is the term of the
    `norm_type`-norm (the statistics columns' order too); None when none is."""
    if is_inf_norm(norm_type):
        return 2
    if stats_norm_type == norm_type:
        return 0
    if norm_type == 2.0:
        return 1
    return None


def flags_of_stats(stats: TensorStats | None, term: float | None) -> int:
    """The UNKNOWN, NAN and INF bits of a piece's statistics and its term_of."""
    if stats is None or term is None:
        return UNKNOWN
    return (NAN if stats.num_nan else 0) | (INF if stats.num_posinf + stats.num_neginf else 0)


@overload
def divide_by_power(value: float, scale: float, exponent: float) -> float: ...


@overload
def divide_by_power(value: np.ndarray, scale: float, exponent: float) -> np.ndarray: ...


def divide_by_power(value: float | np.ndarray, scale: float, exponent: float) -> float | np.ndarray:
    """value / scale**exponent for scale > 0, without overflow or division by zero in between:
    the result is inf or 0 only when it is beyond float64 itself. `value` may be a float64 array
    (each element as the float would be)."""
    try:
        divisor = float(scale**exponent)
        if divisor != 0.0 and math.isfinite(divisor):
            return value / divisor
    except OverflowError:
        pass
    if not isinstance(value, float | int):
        import numpy as np

        return np.array(
            [divide_by_power(float(v), scale, exponent) for v in value.tolist()], dtype=np.float64
        )
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
