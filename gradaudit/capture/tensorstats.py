"""Per-tensor float64 statistics, computed by chunks where the tensor lives (GPU or CPU)."""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..model import TensorStats

CHUNK_ELEMENTS = 1 << 22
"""Elements per chunk on an accelerator, where each kernel launch costs more than the bytes it reads."""
CPU_CHUNK_ELEMENTS = 1 << 19
"""Elements per chunk on the CPU: the 4 MiB float64 copy stays in cache between the reductions that
read it, and the few kernels per chunk cost little beside it (1 << 16 to 1 << 20 measured: smaller
chunks pay more per call than they gain in cache)."""
_GOLDEN = 0x9E3779B1
FINGERPRINT_PERIOD = 1 << 12
"""The fingerprint weight of element i is w[i mod 4096]: a matrix product per chunk, not a hash per element."""
_NATIVE_EXTREMES = {"torch.float64", "torch.float32", "torch.float16", "torch.bfloat16"}
"""Dtypes whose min and max are taken on the tensor itself (fewer bytes than its float64 copy); torch
has no CPU aminmax for the float8 types."""

_weight_tables: dict[str, torch.Tensor] = {}
_scratch = threading.local()


def chunk_elements_for(device: torch.device) -> int:
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS


def fingerprint_weights(device: torch.device | str) -> torch.Tensor:
    """w[j] = ((j * 2654435761) mod 2^32) * 2^-31 - 1 for j < 4096, float64, cached per device."""
    return _weight_table(device)[0]


def _weight_table(device: torch.device | str) -> torch.Tensor:
    """(2, 4096) float64: the fingerprint weights over a row of ones, so that one matrix-vector product
    with a chunk's column sums gives both sum x*w and sum x."""
    key = str(device)
    table = _weight_tables.get(key)
    if table is None:
        index = torch.arange(FINGERPRINT_PERIOD, dtype=torch.int64)
        weights = ((index * _GOLDEN) % (1 << 32)).to(torch.float64) * (2.0 / (1 << 32)) - 1.0
        table = torch.stack([weights, torch.ones_like(weights)])
        table = _weight_tables[key] = table.to(device)
    return table


class _Scratch:
    """Per thread and device: the float64 buffer a chunk is widened into (a fresh allocation per chunk
    would cost more in page faults than the conversion itself), a row of ones as long as the buffer
    has fingerprint periods, and the weight table."""

    def __init__(self, device: torch.device, length: int) -> None:
        size = max(length, chunk_elements_for(device) + FINGERPRINT_PERIOD)
        self.buffer = torch.empty(size, dtype=torch.float64, device=device)
        self.ones = torch.ones(size // FINGERPRINT_PERIOD, dtype=torch.float64, device=device)
        self.table = _weight_table(device)


def _scratch_for(device: torch.device, length: int) -> _Scratch:
    found: dict[torch.device, _Scratch] | None = getattr(_scratch, "by_device", None)
    if found is None:
        found = _scratch.by_device = {}
    scratch = found.get(device)
    if scratch is None or scratch.buffer.numel() < length:
        scratch = found[device] = _Scratch(device, length)
    return scratch


def _padded(flat: torch.Tensor, phase: int) -> tuple[torch.Tensor, _Scratch]:
    """`flat` as float64 at offset `phase` of the scratch buffer, zeros before and after it up to a
    whole number of fingerprint periods, so that every chunk is reduced by the same few kernels."""
    stop = phase + flat.numel()
    length = -(-stop // FINGERPRINT_PERIOD) * FINGERPRINT_PERIOD
    scratch = _scratch_for(flat.device, length)
    buffer = scratch.buffer
    x = buffer[:length]
    if phase:
        buffer[:phase].zero_()
    if length > stop:
        buffer[stop:length].zero_()
    (x[phase:stop] if phase or length > stop else x).copy_(flat)
    return x, scratch


SMALL_DOT_ELEMENTS = 1 << 16


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """sum x^2 of a padded chunk, shape (1,). A short chunk on the CPU goes through BLAS's gemv, not
    its dot: with two intra-op threads on a loaded machine, torch.dot (and vdot) of 4096 doubles took
    2-15 ms a call (OpenBLAS's own threads contending with OpenMP's; gemv of this size runs on one),
    which made the stats capture of 10^5 small tensors ten times slower than with one thread."""
    if x.device.type == "cpu" and x.numel() <= SMALL_DOT_ELEMENTS:
        return torch.mv(x.view(1, -1), x)
    return torch.dot(x, x).reshape(1)


class StatsAccumulator:
    """Feed consecutive flattened chunks of one tensor; `result()` gives its TensorStats.

    Sums run in float64 over finite values only; nonfinite values are counted by kind. The
    fingerprint is (sum x, sum x*w) with a fixed pseudo-random weight w per element position, so
    two replicas agree on it and two different tensors almost never do.

    Each chunk costs a min and max on its own dtype, one widening copy into a cached float64 buffer,
    and two BLAS reductions of that copy (the sum of squares; the column sums over fingerprint
    periods, then their product with the weight table), all queued on the tensor's device; `result()`
    copies them to the host once. A chunk whose min or max is not finite is reduced again with its
    nonfinite values counted and masked, so the chunks passed to `add` must stay unchanged until
    `result()`.
    """

    def __init__(self, norm_type: float) -> None:
        self.norm_type = float(norm_type)
        self.numel = 0
        self._chunks: list[tuple[int, torch.Tensor]] = []
        self._sums: list[torch.Tensor] = []
        self._extremes: list[torch.Tensor] = []

    def add(self, chunk: torch.Tensor, chunk_elements: int | None = None) -> None:
        """Feed `chunk`, cut into chunks of at most `chunk_elements` (and of its device's size)."""
        flat = chunk.reshape(-1)
        step = min(chunk_elements or CHUNK_ELEMENTS, chunk_elements_for(flat.device))
        for start in range(0, flat.numel(), step):
            self._add(flat[start : start + step])

    def _add(self, flat: torch.Tensor) -> None:
        native = str(flat.dtype) in _NATIVE_EXTREMES
        if native:  # first: the widening then reads the chunk from cache
            self._extremes += torch.aminmax(flat)
        x, scratch = _padded(flat, self.numel % FINGERPRINT_PERIOD)
        self._sums.extend(self._reduce(x, scratch))
        if not native:
            self._extremes += torch.aminmax(x)
        self._chunks.append((self.numel, flat))
        self.numel += flat.numel()

    def _reduce(self, x: torch.Tensor, scratch: _Scratch) -> list[torch.Tensor]:
        """[sum x^2], [sum x*w, sum x] and, for p other than 2 and inf, [sum |x|^p] of a padded chunk.
        The column sums are a product with a row of ones: BLAS does it twice as fast as sum(0)."""
        rows = x.view(-1, FINGERPRINT_PERIOD)
        column_sums = x if rows.shape[0] == 1 else torch.mv(rows.t(), scratch.ones[: rows.shape[0]])
        sums = [_sum_of_squares(x), torch.mv(scratch.table, column_sums)]
        p = self.norm_type
        if p == 1.0:
            sums.append(x.abs().sum().reshape(1))
        elif p != 2.0 and not math.isinf(p):
            sums.append(x.abs().pow(p).sum().reshape(1))
        return sums

    def _masked(self, offset: int, flat: torch.Tensor) -> tuple[list[float], float, list[int]]:
        """The sums, the max |x| and the nonfinite counts of a chunk with nonfinite values (rare: host
        synchronisations here are fine)."""
        x, scratch = _padded(flat, offset % FINGERPRINT_PERIOD)
        counts = [int(torch.isnan(x).sum()), int((x == math.inf).sum()), int((x == -math.inf).sum())]
        x.masked_fill_(~torch.isfinite(x), 0.0)
        sums = torch.cat(self._reduce(x, scratch)).tolist()
        return sums, float(x.abs().max()), counts

    def result(self) -> TensorStats:
        width = 3 if self.norm_type == 2.0 or math.isinf(self.norm_type) else 4  # sums per chunk (_reduce)
        columns: list[list[float]] = [[] for _ in range(width)]
        max_abs = 0.0
        counts = [0, 0, 0]
        if self._chunks:
            if self._chunks[0][1].device.type == "cpu":  # no transfer to save: skip the concatenation
                values = [v for t in self._sums for v in t.tolist()] + [float(t) for t in self._extremes]
            else:
                sums = torch.cat(self._sums)
                values = torch.cat([sums, torch.stack(self._extremes).to(sums.dtype)]).tolist()
            extremes = values[len(self._chunks) * width :]
            for i, (offset, flat) in enumerate(self._chunks):
                low, high = extremes[2 * i], extremes[2 * i + 1]
                if math.isfinite(low) and math.isfinite(high):
                    row, chunk_max = values[i * width : (i + 1) * width], max(-low, high)
                else:
                    row, chunk_max, chunk_counts = self._masked(offset, flat)
                    counts = [a + b for a, b in zip(counts, chunk_counts, strict=True)]
                for column, value in zip(columns, row, strict=True):
                    column.append(value)
                max_abs = max(max_abs, chunk_max)
        sum_sq, fp_proj, fp_sum = (math.fsum(c) for c in columns[:3])
        sum_pow = max_abs if math.isinf(self.norm_type) else (sum_sq if width == 3 else math.fsum(columns[3]))
        return TensorStats(
            numel=self.numel,
            norm_type=self.norm_type,
            sum_pow=sum_pow,
            sum_sq=sum_sq,
            max_abs=max_abs,
            num_nan=counts[0],
            num_posinf=counts[1],
            num_neginf=counts[2],
            fingerprint=(fp_sum, fp_proj),
        )


def stats_of_tensor(tensor: torch.Tensor, norm_type: float, chunk_elements: int | None = None) -> TensorStats:
    if 0 < tensor.numel() <= SMALL_ELEMENTS and chunk_elements is None:
        return stats_from_row(stats_rows([tensor], norm_type)[0], tensor.numel(), norm_type)
    acc = StatsAccumulator(norm_type)
    acc.add(tensor.detach(), chunk_elements)
    return acc.result()


SMALL_ELEMENTS = FINGERPRINT_PERIOD
"""Tensors of at most this many elements are summarized in batches (`stats_rows`): for them the
Python and kernel-launch cost of a call per tensor is all there is to pay."""
BATCH_ELEMENTS = 1 << 20
"""Elements widened to float64 at once in a batch of small tensors on an accelerator."""
CPU_BATCH_ELEMENTS = 1 << 14
"""The same on the CPU: under torch's intra-op grain size (32768 elements), so that each reduction
runs on the calling thread; with two contending intra-op threads on a loaded machine a batch of
2^20 took 3-5x longer than 64 batches of 2^14."""
STATS_COLUMNS = ("sum_pow", "sum_sq", "max_abs", "fp_sum", "fp_proj", "num_nan", "num_posinf", "num_neginf")
"""The columns of `stats_rows`: the first five as the dump's stats columns store them, then the counts."""


def stats_rows(
    tensors: Sequence[torch.Tensor],
    norm_type: float,
    groups: Mapping[tuple[Any, ...], Sequence[int]] | None = None,
) -> np.ndarray:
    """[len(tensors), 8] float64 (STATS_COLUMNS) statistics of each tensor, the same as `stats_of_tensor`.

    Tensors of up to SMALL_ELEMENTS elements are stacked by (shape, dtype, device) and reduced a
    batch at a time where they live, with one copy to the host per device; larger ones go through
    the chunked accumulator one by one. `groups` gives those (shape, dtype, device) -> positions
    when the caller knows them; the rows of positions in no group are zeros."""
    out = np.zeros((len(tensors), len(STATS_COLUMNS)), dtype=np.float64)
    if groups is None:
        found: defaultdict[tuple[Any, ...], list[int]] = defaultdict(list)
        for position, tensor in enumerate(tensors):
            found[(tensor.shape, tensor.dtype, tensor.device)].append(position)
        groups = found
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for (shape, _dtype, device), positions in groups.items():
        numel = math.prod(shape)
        if not 0 < numel <= SMALL_ELEMENTS:
            for position in positions if numel else ():
                stats = stats_of_tensor(tensors[position], norm_type)
                counts = (stats.num_nan, stats.num_posinf, stats.num_neginf)
                out[position] = (stats.sum_pow, stats.sum_sq, stats.max_abs, *stats.fingerprint, *counts)
            continue
        weights = fingerprint_weights(device)[:numel]  # numel <= SMALL_ELEMENTS, one fingerprint period
        step = max(1, (CPU_BATCH_ELEMENTS if device.type == "cpu" else BATCH_ELEMENTS) // numel)
        taken, results = by_device.setdefault(device, ([], []))
        for start in range(0, len(positions), step):
            chosen = positions[start : start + step]
            stacked = torch.stack([tensors[i] for i in chosen]).reshape(len(chosen), numel)
            results.append(_batch_rows(stacked.to(torch.float64), weights, float(norm_type)))
            taken.extend(chosen)
    for taken, results in by_device.values():
        out[taken] = torch.cat(results).cpu().numpy()
    return out


def _batch_rows(x: torch.Tensor, weights: torch.Tensor, norm_type: float) -> torch.Tensor:
    """STATS_COLUMNS of each row of the float64 matrix `x` (one small tensor a row), as a matrix on
    its device; `x` is overwritten (nonfinite values zeroed)."""
    counts = [torch.isnan(x).sum(1), (x == math.inf).sum(1), (x == -math.inf).sum(1)]
    x.masked_fill_(~torch.isfinite(x), 0.0)
    magnitudes = x.abs()
    max_abs = magnitudes.amax(1)
    sum_sq = (x * x).sum(1)
    if norm_type == 2.0:
        sum_pow = sum_sq
    elif math.isinf(norm_type):
        sum_pow = max_abs
    elif norm_type == 1.0:
        sum_pow = magnitudes.sum(1)
    else:
        sum_pow = magnitudes.pow(norm_type).sum(1)
    columns = [sum_pow, sum_sq, max_abs, x.sum(1), (x * weights).sum(1)]
    return torch.stack([*columns, *(c.to(torch.float64) for c in counts)], dim=1)


def stats_from_row(row: Sequence[float], numel: int, norm_type: float) -> TensorStats:
    """The TensorStats of one row of `stats_rows`."""
    sum_pow, sum_sq, max_abs, fp_sum, fp_proj, nan, posinf, neginf = (float(v) for v in row)
    return TensorStats(
        numel=numel,
        norm_type=float(norm_type),
        sum_pow=sum_pow,
        sum_sq=sum_sq,
        max_abs=max_abs,
        num_nan=int(nan),
        num_posinf=int(posinf),
        num_neginf=int(neginf),
        fingerprint=(fp_sum, fp_proj),
    )
