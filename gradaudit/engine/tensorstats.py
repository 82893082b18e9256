"""Per-tensor float64 statistics, computed by chunks where the tensor lives (GPU or CPU)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..model import TensorStats

if TYPE_CHECKING:
    import torch

CHUNK_ELEMENTS = 1 << 22
_GOLDEN = 0x9E3779B1
FINGERPRINT_PERIOD = 1 << 12
"""The fingerprint weight of element i is w[i mod 4096]: a matrix product per chunk, not a hash per element."""

_weight_tables: dict[str, torch.Tensor] = {}
_scratch = threading.local()


def _widened(flat: torch.Tensor) -> torch.Tensor:
    """`flat` as float64 in a reused per-thread buffer: a fresh allocation per chunk costs more in page
    faults than the conversion itself."""
    import torch

    if flat.dtype == torch.float64:
        return flat
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    key = str(flat.device)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < flat.numel():
        buffer = buffers[key] = torch.empty(
            max(flat.numel(), CHUNK_ELEMENTS), dtype=torch.float64, device=flat.device
        )
    return buffer[: flat.numel()].copy_(flat)


def fingerprint_weights(device: torch.device | str) -> torch.Tensor:
    """w[j] = ((j * 2654435761) mod 2^32) * 2^-31 - 1 for j < 4096, float64, cached per device."""
    import torch

    key = str(device)
    table = _weight_tables.get(key)
    if table is None:
        index = torch.arange(FINGERPRINT_PERIOD, dtype=torch.int64)
        table = ((index * _GOLDEN) % (1 << 32)).to(torch.float64) * (2.0 / (1 << 32)) - 1.0
        table = _weight_tables[key] = table.to(device)
    return table


class StatsAccumulator:
    """Feed consecutive flattened chunks of one tensor; `result()` gives its TensorStats.

    Sums run in float64 over finite values only; nonfinite values are counted by kind. The
    fingerprint is (sum x, sum x*w) with a fixed pseudo-random weight w per element position, so
    two replicas agree on it and two different tensors almost never do. Everything stays on the
    tensor's device until `result()`.
    """

    def __init__(self, norm_type: float) -> None:
        self.norm_type = float(norm_type)
        self.numel = 0
        self._sum_pow: list[torch.Tensor] = []
        self._sum_sq: list[torch.Tensor] = []
        self._max_abs: list[torch.Tensor] = []
        self._counts = [0, 0, 0]
        self._fp_sum: list[torch.Tensor] = []
        self._fp_proj: list[torch.Tensor] = []

    def add(self, chunk: torch.Tensor) -> None:
        import torch

        flat = chunk.reshape(-1)
        if flat.numel() == 0:
            return
        x = _widened(flat)
        total = x.sum()
        if not bool(torch.isfinite(total)):
            x = self._count_and_mask_nonfinite(x)
            total = x.sum()
        low, high = torch.aminmax(x)
        self._max_abs.append(torch.maximum(-low, high))
        sq = torch.dot(x, x)
        self._sum_sq.append(sq)
        p = self.norm_type
        if p == 2.0:
            self._sum_pow.append(sq)
        elif p == 1.0:
            self._sum_pow.append(x.abs().sum())
        elif not math.isinf(p):
            self._sum_pow.append(x.abs().pow(p).sum())
        self._fp_sum.append(total)
        self._fp_proj.append(self._projection(x))
        self.numel += x.numel()

    def _count_and_mask_nonfinite(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        finite = torch.isfinite(x)
        self._counts[0] += int(torch.isnan(x).sum())
        self._counts[1] += int((x == math.inf).sum())
        self._counts[2] += int((x == -math.inf).sum())
        return torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def _projection(self, x: torch.Tensor) -> torch.Tensor:
        """sum_i x_i * w[(offset + i) mod P], as one matrix-vector product over whole periods."""
        import torch

        weights = fingerprint_weights(x.device)
        period = FINGERPRINT_PERIOD
        phase = self.numel % period
        head = min(x.numel(), (period - phase) % period)
        result = torch.dot(x[:head], weights[phase : phase + head])
        body = (x.numel() - head) // period * period
        if body:
            result = result + (x[head : head + body].view(-1, period) @ weights).sum()
        tail = x[head + body :]
        if tail.numel():
            result = result + torch.dot(tail, weights[: tail.numel()])
        return result

    def result(self) -> TensorStats:

        def total(parts: Iterable[torch.Tensor]) -> float:
            return math.fsum(float(v) for v in parts)

        max_abs = max((float(v) for v in self._max_abs), default=0.0)
        sum_pow = max_abs if math.isinf(self.norm_type) else total(self._sum_pow)
        return TensorStats(
            numel=self.numel,
            norm_type=self.norm_type,
            sum_pow=sum_pow,
            sum_sq=total(self._sum_sq),
            max_abs=max_abs,
            num_nan=self._counts[0],
            num_posinf=self._counts[1],
            num_neginf=self._counts[2],
            fingerprint=(total(self._fp_sum), total(self._fp_proj)),
        )


def stats_of_chunks(chunks: Iterable[torch.Tensor], norm_type: float) -> TensorStats:
    acc = StatsAccumulator(norm_type)
    for chunk in chunks:
        acc.add(chunk)
    return acc.result()


def stats_of_tensor(
    tensor: torch.Tensor, norm_type: float, chunk_elements: int = CHUNK_ELEMENTS
) -> TensorStats:
    flat = tensor.detach().reshape(-1)
    return stats_of_chunks(
        (flat[i : i + chunk_elements] for i in range(0, flat.numel(), chunk_elements)), norm_type
    )
