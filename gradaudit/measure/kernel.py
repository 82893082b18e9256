"""The check's inner loop: float64 statistics of dumped tensors, chunk by chunk, in numpy.

One `ChunkKernel` per worker thread. Each chunk is read from the file into a reused byte buffer,
widened into a reused float64 buffer (dtypes.Widener) and reduced there while it is in cache: the
sum of squares (one BLAS dot), the sum of |x|^p when p is neither 2 nor inf, the min and max, and
the fingerprint only when asked for. Chunks are small enough (KERNEL_CHUNK_ELEMENTS) that these
reductions read the chunk from cache, so the dump's bytes cross memory once. The common case, all
values finite, is recognised from the sum of squares itself (a nan or inf makes it non-finite);
only then are the nonfinite values counted and zeroed in place.

Results depend only on the chunk size and the values, never on the number of workers or their
order, so the same dump gives the same bits whichever way the parameters were spread.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ..dumpfile.dtypes import F64, Widener
from ..model import TensorKind, TensorStats
from ..norms import safe_fsum

if TYPE_CHECKING:
    from ..dumpfile.reader import TensorReader

KERNEL_CHUNK_ELEMENTS = 1 << 16
"""64K elements (a 512 KiB float64 buffer): small enough that the several reductions of one chunk
read it from cache, large enough that the Python around each chunk is a small share."""

FINGERPRINT_PERIOD = 1 << 12
"""The fingerprint weight of element i is w[i mod 4096] (see fingerprint_weights)."""
_GOLDEN = 0x9E3779B1

Mask = npt.NDArray[np.bool_]

NARROW_FLOATS = frozenset({"float16", "float32"})
"""Dumped dtypes that numpy reads as floats (bf16 and float8 it reads as integers)."""


def fingerprint_weights() -> F64:
    """w[j] = ((j * 2654435761) mod 2^32) * 2^-31 - 1 for j < 4096, float64: the same table as the
    capture side's (tensorstats.fingerprint_weights), every entry exact in float64."""
    index = np.arange(FINGERPRINT_PERIOD, dtype=np.int64)
    return ((index * _GOLDEN) % (1 << 32)).astype(np.float64) * (2.0 / (1 << 32)) - 1.0


_WEIGHTS = fingerprint_weights()


def projection(x: F64, offset: int) -> float:
    """sum_i x_i * w[(offset + i) mod P], as one matrix-vector product over whole periods."""
    period = FINGERPRINT_PERIOD
    phase = offset % period
    head = min(x.size, (period - phase) % period)
    result = float(np.dot(x[:head], _WEIGHTS[phase : phase + head]))
    body = (x.size - head) // period * period
    if body:
        result += float((x[head : head + body].reshape(-1, period) @ _WEIGHTS).sum())
    tail = x[head + body :]
    if tail.size:
        result += float(np.dot(tail, _WEIGHTS[: tail.size]))
    return result


def windows(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    """[start, stop) of each chunk of `chunk` elements of `numel`, in order."""
    for start in range(0, numel, chunk):
        yield start, min(numel, start + chunk)


class StatsSums:
    """Running float64 sums of one tensor's chunks (finite values only)."""

    def __init__(self, norm_type: float, fingerprint: bool = False) -> None:
        self.norm_type, self.fingerprint = norm_type, fingerprint
        self.numel, self.num_nan, self.num_posinf, self.num_neginf = 0, 0, 0, 0
        self.max_abs = 0.0
        self.sum_sq: list[float] = []
        self.sum_pow: list[float] = []
        self.fp_sum: list[float] = []
        self.fp_proj: list[float] = []

    def add(self, wide: F64, scratch: F64, narrow: np.ndarray | None = None) -> Mask | None:
        """Add one float64 chunk; nonfinite values in `wide` are zeroed in place. Returns the mask
        of finite values when some were not (for the pair sums), else None. `scratch` is a buffer
        of wide's size that this may overwrite. `narrow`, the same values as dumped (float16 or
        float32), gives the same min and max from half or a quarter of the bytes."""
        finite_mask = None
        if wide.size == 0:
            return None
        sq = float(np.dot(wide, wide))
        if not math.isfinite(sq):
            finite = np.isfinite(wide)
            if not finite.all():
                finite_mask = finite
                nan = int(np.count_nonzero(np.isnan(wide)))
                positive = int(np.count_nonzero(wide == math.inf))
                self.num_nan += nan
                self.num_posinf += positive
                self.num_neginf += wide.size - int(np.count_nonzero(finite)) - nan - positive
                np.copyto(wide, 0.0, where=~finite)
                sq = float(np.dot(wide, wide))
        extremes = wide if finite_mask is not None or narrow is None else narrow
        self.max_abs = max(self.max_abs, -float(extremes.min()), float(extremes.max()))
        self.sum_sq.append(sq)
        p = self.norm_type
        if p == 2.0:
            self.sum_pow.append(sq)
        elif p == 1.0:
            self.sum_pow.append(float(np.abs(wide, out=scratch).sum()))
        elif not math.isinf(p):
            np.abs(wide, out=scratch)
            self.sum_pow.append(float(np.power(scratch, p, out=scratch).sum()))
        if self.fingerprint:
            self.fp_sum.append(float(wide.sum()))
            self.fp_proj.append(projection(wide, self.numel))
        self.numel += wide.size
        return finite_mask

    def result(self, numel: int) -> TensorStats:
        inf_norm = math.isinf(self.norm_type)
        return TensorStats(
            numel=numel,
            norm_type=self.norm_type,
            sum_pow=self.max_abs if inf_norm else safe_fsum(self.sum_pow),
            sum_sq=safe_fsum(self.sum_sq),
            max_abs=self.max_abs,
            num_nan=self.num_nan,
            num_posinf=self.num_posinf,
            num_neginf=self.num_neginf,
            fingerprint=(safe_fsum(self.fp_sum), safe_fsum(self.fp_proj)) if self.fingerprint else (),
        )


def stats_of_array(
    values: np.ndarray, dtype: str, norm_type: float, chunk: int = KERNEL_CHUNK_ELEMENTS
) -> TensorStats:
    """TensorStats of a whole array in its storage dtype (dtypes.STORAGE), fingerprint included."""
    widener = Widener(chunk)
    sums = StatsSums(float(norm_type), fingerprint=True)
    flat = values.reshape(-1)
    with np.errstate(all="ignore"):
        for start in range(0, flat.size, chunk):
            part = flat[start : start + chunk]
            if dtype == "float64":  # copied: the kernel zeroes nonfinite values in place
                wide = widener.buffer("x", part.size)
                np.copyto(wide, part)
            else:
                wide = widener.widen(part, dtype, "x")
            sums.add(wide, widener.buffer("scratch", part.size))
    return sums.result(flat.size)


class ChunkKernel:
    """Reusable buffers (one per tensor kind) and the reductions of one worker."""

    def __init__(self, chunk_elements: int = KERNEL_CHUNK_ELEMENTS) -> None:
        self.chunk_elements = chunk_elements
        self.widener = Widener(chunk_elements)

    def read_piece(
        self,
        reader: TensorReader,
        path: str,
        tensors: Mapping[TensorKind, str],
        numel: int,
        norm_type: float,
        *,
        fingerprint: bool = False,
    ) -> tuple[dict[TensorKind, TensorStats], float | None, float | None, float | None]:
        """One pass over every tensor a piece of `numel` elements holds (kind -> its key in the file
        at `path`), in aligned chunks: ({kind: TensorStats},
        sum grad*grad_clipped, sum grad*grad, sum (param_after - param_before)^2), the sums over the
        elements finite in both tensors of the pair (None when the pair was not dumped).

        The fingerprint (a weighted sum per element position) is computed only when asked for:
        replicas with values are compared by value, so only a replica set that mixes values with
        stats-only copies needs it."""
        kinds = sorted(tensors)
        dtypes = {kind: reader.entry(path, tensors[kind]).dtype for kind in kinds}
        sums = {kind: StatsSums(float(norm_type), fingerprint=fingerprint) for kind in kinds}
        pre_post = "grad" in tensors and "grad_clipped" in tensors
        update = "param_before" in tensors and "param_after" in tensors
        pairs: tuple[list[float], list[float], list[float]] = ([], [], [])
        """Per chunk: sum grad*grad_clipped, sum grad*grad, sum (param_after - param_before)^2."""
        with np.errstate(all="ignore"):
            for start, stop in windows(numel, self.chunk_elements):
                wide: dict[str, F64] = {}
                masks: dict[str, Mask | None] = {}
                scratch = self.widener.buffer("scratch", stop - start)
                for kind in kinds:
                    raw = reader.raw(path, tensors[kind], start, stop, kind)
                    wide[kind] = self.widener.widen(raw, dtypes[kind], kind)
                    narrow = raw if dtypes[kind] in NARROW_FLOATS else None
                    masks[kind] = sums[kind].add(wide[kind], scratch, narrow)
                if pre_post:
                    grad, clipped = _finite_in_both(wide, masks, "grad", "grad_clipped")
                    pairs[0].append(float(np.dot(grad, clipped)))
                    pairs[1].append(float(np.dot(grad, grad)))
                if update:
                    before, after = _finite_in_both(wide, masks, "param_before", "param_after")
                    difference = np.subtract(after, before, out=scratch)
                    pairs[2].append(float(np.dot(difference, difference)))
        stats = {kind: s.result(numel) for kind, s in sums.items()}
        dot_pre_post, dot_pre_pre, update_sum_sq = (safe_fsum(chunks) for chunks in pairs)
        return (
            stats,
            dot_pre_post if pre_post else None,
            dot_pre_pre if pre_post else None,
            update_sum_sq if update else None,
        )


def _finite_in_both(
    wide: Mapping[str, F64], masks: Mapping[str, Mask | None], a: TensorKind, b: TensorKind
) -> tuple[F64, F64]:
    """The chunks of kinds `a` and `b`, zeroed where either is not finite. Nonfinite values were
    zeroed already; where only one of the two was, the other is zeroed here too (in place: the
    chunk is done)."""
    mask_a, mask_b = masks[a], masks[b]
    both = mask_a if mask_b is None else (mask_b if mask_a is None else mask_a & mask_b)
    if both is not None:
        np.copyto(wide[a], 0.0, where=~both)
        np.copyto(wide[b], 0.0, where=~both)
    return wide[a], wide[b]
