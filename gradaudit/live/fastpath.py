"""The guard's common path: every rank's row reduced to one fixed-size sum, and the verdict read from
that sum when its numbers agree, with no per-rank numbers and no report. No torch.

Each rank adds its contribution to one all-reduce (SUM) of float64 numbers, whatever the world size:
- counts: the ranks, their statuses, the ranks whose parameters changed;
- values every rank must hold alike (the stamp, the number of clip calls, the scaler's state, the
  gradients' dtype, the clip call's reported norm, max_norm and norm_type), each as the sums of its
  four 16-bit pieces and of their squares: n * sum(c^2) == sum(c)^2 exactly when every rank's bits are
  equal (integers below 2**53 add exactly in float64), and the common value is read back bit for bit;
- per ownership group: the group's sum |g|^p from the lowest rank holding each copy (the true norm,
  each element once), the nonfinite pieces, and each copy's bits against its lowest holder's, the same
  way (holders add their bits, the lowest holder adds its own times the copy's holders: the two sums are
  equal exactly when every replica holds the same bits);
- the ranks whose applied coefficient is known, its distance from the one the rank's own reported norm
  expects, and its square.

`verdict` passes a step only where the full analysis finds nothing wrong, with room: within a quarter of
the dtype's tolerance, away from max_norm itself, one clip call, nothing nonfinite, no replica that
differs. Anything else is `None`: the ranks then gather their rows and the full diagnosis runs, as
`gradaudit check` runs it (every rank reads the same sum, so every rank takes the same path).
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from ..norms import NORM_RTOL_BY_DTYPE, expected_clip_coef, is_inf_norm, norm_from_total
from .summary import CHANGED, CLOCK, FAILED, GRAD_DTYPES, HEADER, OFF, OK, SKIP, STEP, VectorLayout

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ..model import Topology
    from .analysis_input import OwnershipGroup

CHUNKS = 4
"""16-bit pieces of a float64's bits: a piece's square times the ranks stays below 2**53 up to 2**21 ranks."""
_STATUSES = (OK, FAILED, OFF, SKIP)
_COUNT, _STATUS, _CHANGED = 0, 1, 1 + len(_STATUSES)
_LEFT = _CHANGED + 1
"""The sum of the ranks whose guard left (OFF): it names the rank when one left alone."""
_TINY_TERMS = _LEFT + 1
_HEADER = _TINY_TERMS + 1
_EQUAL = (
    "step",
    "clock",
    "calls",
    "loss_scale",
    "unscaled",
    "skipped",
    "dtype",
    "reported",
    "max_norm",
    "norm_type",
)
"""The values every rank must hold alike on the common path, in their order in the sum."""
_PER_EQUAL = 2 * CHUNKS
_COPIES = 4 * CHUNKS
"""Of one copy's value: the holders' pieces and their squares, the lowest holder's times the holders."""
_PER_GROUP = 2 + 2 * _COPIES
_TINY = 1e-290
"""A rank's sum of a group below this (and above 0) leaves the step to the full diagnosis: clipped,
such a term underflows, and the coefficient per group it measures is not what the sum says."""
SAFETY = 4.0
"""The common path passes a step within 1/SAFETY of the tolerance the analysis allows."""


@dataclass(frozen=True, kw_only=True)
class RankRole:
    """What one rank's contribution needs to know of the ownership groups, fixed until re-inference."""

    lowest: tuple[bool, ...]
    """Per group: this rank is the lowest holder of its copy (its sum counts toward the true norm)."""
    holders: tuple[int, ...]
    """Per group: how many ranks hold this rank's copy (0 where it holds none)."""
    rank: int = 0


def role_of(
    rank: int,
    groups: Sequence[OwnershipGroup],
    held: Sequence[Sequence[bool]],
    topologies: Sequence[Topology],
) -> RankRole:
    """`rank`'s role: per group, whether it is the lowest holder of its copy (the ranks of the group's
    replica group that hold it, as the analysis' cover takes each copy once), and how many hold it."""
    lowest, holders = [], []
    for i, group in enumerate(groups):
        if not held[rank][i]:
            lowest.append(False)
            holders.append(0)
            continue
        members: tuple[int, ...] = (rank,)
        if group.replica_group is not None:
            members = topologies[rank].group_of(group.replica_group, rank) or (rank,)
        holding = [r for r in members if held[r][i]] or [rank]
        lowest.append(min(holding) == rank)
        holders.append(len(holding))
    return RankRole(lowest=tuple(lowest), holders=tuple(holders), rank=rank)


@dataclass(frozen=True, kw_only=True)
class Reduction:
    """Where each number of the reduced vector lies (the same on every rank)."""

    layout: VectorLayout

    @property
    def num_groups(self) -> int:
        return self.layout.num_groups

    @property
    def size(self) -> int:
        return _HEADER + len(_EQUAL) * _PER_EQUAL + self.num_groups * _PER_GROUP + 3

    def _group_at(self, group: int) -> int:
        return _HEADER + len(_EQUAL) * _PER_EQUAL + group * _PER_GROUP

    def contribution(self, row: np.ndarray, role: RankRole, declared_max_norm: float) -> np.ndarray:
        """This rank's part of the sum, from its row (see summary.VectorLayout). In Python numbers, not
        numpy operations: it runs right after the model's step, when a few dozen small numpy calls cost
        several times what they cost warm (see bench/guard_fixed.py's cold-against-warm line)."""
        g, count, r = self.num_groups, len(_EQUAL), row.tolist()
        status = r[0]
        out = [1.0, *map(float, map(status.__eq__, _STATUSES)), float(r[CHANGED] == 1.0), 0.0, 0.0]
        if status == OFF:
            out[_LEFT] = float(role.rank)
        # every value's 16-bit pieces, lowest first, in one split: the values every rank holds alike,
        # then per group the gradients' and the weights' copies
        values = _taken(self.layout)(r)
        pieces = struct.unpack(f"<{CHUNKS * len(values)}H", struct.pack(f"<{len(values)}d", *values))
        squares = tuple(map(operator.mul, pieces, pieces))  # C-level maps: no comprehension's frame
        out += pieces[: CHUNKS * count]
        out += squares[: CHUNKS * count]
        for i in range(g):
            held = 1.0 if role.holders[i] > 0 else 0.0
            term = values[count + i]
            out[_TINY_TERMS] += float(0.0 < term < _TINY and held > 0)
            out += (term if role.lowest[i] else 0.0, (r[HEADER + g + i] + r[HEADER + 2 * g + i]) * held)
            # per copy (gradients, weights), per factor (held, lowest x holders), per power (1, 2)
            for copy in (count + i, count + g + i):
                at = CHUNKS * copy
                both = pieces[at : at + CHUNKS] + squares[at : at + CHUNKS]
                for factor in (held, role.lowest[i] * role.holders[i]):
                    out += map(operator.mul, both, itertools.repeat(factor, 2 * CHUNKS))
        applied, reported, passed = r[2], values[7], values[8]
        max_norm = passed if math.isfinite(passed) else declared_max_norm
        deviation = applied - expected_clip_coef(reported, max_norm)
        # unknown where the sample is all zero: that rank's is not checked
        out += (1.0, deviation, deviation * deviation) if math.isfinite(deviation) else (0.0, 0.0, 0.0)
        return np.array(out, dtype=np.float64)

    def verdict(self, sums: np.ndarray, *, norm_type: float, max_norm: float) -> FastVerdict | None:
        """The step's verdict when the summed numbers agree (see the module's docstring); None when the
        full diagnosis must say it."""
        s = sums.tolist()  # Python numbers: see `contribution`
        n = s[_COUNT]
        left = int(s[_STATUS + _STATUSES.index(OFF)])
        if left:  # its guard will not take part in another exchange: concluded from the sum alone
            return FastVerdict(kind="off", max_norm=max_norm, left=(int(s[_LEFT]),) if left == 1 else ())
        if not n >= 1 or s[_CHANGED] != 0:
            return None
        common = _common(s[_HEADER : _HEADER + len(_EQUAL) * _PER_EQUAL], int(n))
        if common is None:
            return None
        _, _, calls, _, unscaled, skipped_by, dtype, reported, passed, passed_type = common  # _EQUAL's order
        if s[_STATUS + _STATUSES.index(SKIP)] == n:
            return FastVerdict(kind="not_measured", max_norm=max_norm)  # paused alike, or captured in full
        if s[_STATUS] != n or s[_TINY_TERMS] or is_inf_norm(norm_type):
            return None
        if calls != 1.0 or unscaled == 0.0 or math.isnan(dtype):
            return None  # several or no clip calls; clipped before unscale_; no gradient
        if not math.isnan(passed_type) and passed_type != norm_type:
            return None
        used = passed if math.isfinite(passed) and passed > 0 else max_norm
        if skipped_by == 1.0:
            return FastVerdict(kind="skipped", reported_norm=reported, max_norm=used, passed_max_norm=passed)
        total, half = 0.0, 2 * CHUNKS
        for at in range(self._group_at(0), self._group_at(self.num_groups), _PER_GROUP):
            block = s[
                at : at + _PER_GROUP
            ]  # term, nonfinite, then per copy (gradients, weights): holders, lowest
            if block[1] or any(
                block[c : c + half] != block[c + half : c + 2 * half] for c in (2, 2 + 2 * half)
            ):
                return None  # nonfinite, or a replica's gradient or weights differ from its lowest holder's
            total += block[0]
        true_norm = norm_from_total(total, norm_type)
        rtol = NORM_RTOL_BY_DTYPE[GRAD_DTYPES[int(dtype)]] / SAFETY
        if not (math.isfinite(true_norm) and true_norm > 0 and math.isfinite(reported)):
            return None
        if abs(reported - true_norm) > rtol * true_norm or abs(true_norm - used) <= 2 * SAFETY * rtol * used:
            return None  # a wrong norm, or one at max_norm itself (what clipping leaves behind)
        expected = expected_clip_coef(true_norm, used)
        known, own = s[-3], expected_clip_coef(reported, used)
        mean = s[-2] / known if known else 0.0
        spread = math.sqrt(max(0.0, s[-1] - known * mean * mean))
        if not math.isfinite(mean) or abs(own - expected) + abs(mean) + spread > rtol * expected:
            return None
        return FastVerdict(
            true_norm=true_norm,
            reported_norm=reported,
            expected_coef=expected,
            min_coef=own + mean - spread if known else None,
            max_coef=own + mean + spread if known else None,
            max_norm=used,
            passed_max_norm=passed,
        )


@dataclass(frozen=True, kw_only=True)
class FastVerdict:
    """A step the common path concluded: passed (its trend line's numbers), skipped by every rank's
    scaler, measured by no rank, or the step a rank's guard left at."""

    kind: Literal["passed", "skipped", "not_measured", "off"] = "passed"
    left: tuple[int, ...] = ()
    """Of "off": the rank whose guard left, when one left alone."""
    true_norm: float | None = None
    reported_norm: float | None = None
    expected_coef: float | None = None
    min_coef: float | None = None
    max_coef: float | None = None
    """The applied coefficients lie between these: equal when every rank applied the same bits; else the
    bounds the summed distances give (the per-rank numbers are gathered only for a failing step). None
    when no rank's sample could measure it (all zero)."""
    max_norm: float
    """What the step was checked against."""
    passed_max_norm: float = math.nan
    """What every rank's clip call passed as max_norm (nan: not known)."""


@functools.lru_cache(maxsize=8)
def _taken(layout: VectorLayout) -> Callable[[list[float]], tuple[float, ...]]:
    """What takes from a row the values split into pieces: those every rank holds alike (in _EQUAL's
    order), then per group the gradients' copy, then the weights'."""
    g, call, weights = layout.num_groups, layout.call_offset(0), layout.weights_offset
    alike = (STEP, CLOCK, 1, 3, 4, 5, 6, call, call + 1, call + 2)
    taken = (*alike, *range(HEADER, HEADER + g), *range(weights, weights + g))
    return operator.itemgetter(*taken)  # taken holds more than one index: a tuple


def _common(sums: list[float], n: int) -> list[float] | None:
    """The values whose pieces every rank added (the sums of every value's pieces, then of their
    squares); None when some value's bits differ between ranks. Exact: a mean piece m = sum / n is
    every rank's only when sum == n * m and sum(c^2) == n * m^2, all integers below 2**53."""
    half = len(sums) // 2
    totals = sums[:half]  # integers below 2**53: exact as floats
    means = [total // n for total in totals]
    if [mean * n for mean in means] != totals or [n * mean * mean for mean in means] != sums[half:]:
        return None
    return list(struct.unpack(f"<{half // CHUNKS}d", struct.pack(f"<{half}H", *map(int, means))))
