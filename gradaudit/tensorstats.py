"""Per-tensor float64 statistics, computed by chunks where the tensor lives (GPU or CPU)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable

from .model import TensorStats

if TYPE_CHECKING:
    import torch

CHUNK_ELEMENTS = 1 << 22
_GOLDEN = 0x9E3779B1


class StatsAccumulator:
    """Feed consecutive flattened chunks of one tensor; `result()` gives its TensorStats.

    Sums run in float64 over finite values only; nonfinite values are counted by kind. The
    fingerprint is (sum x, sum x*w) with a fixed pseudo-random weight w per element position, so
    two replicas agree on it and two different tensors almost never do.
    """

    def __init__(self, norm_type: float) -> None:
        self.norm_type = float(norm_type)
        self.numel = 0
        self._sum_pow = []
        self._sum_sq = []
        self._max_abs = 0.0
        self._counts = [0, 0, 0]
        self._fp_sum = []
        self._fp_proj = []

    def add(self, chunk: "torch.Tensor") -> None:
        import torch

        flat = chunk.reshape(-1)
        if flat.numel() == 0:
            return
        x = flat.to(torch.float64)
        finite = torch.isfinite(x)
        all_finite = bool(finite.all())
        if not all_finite:
            nan = torch.isnan(x)
            self._counts[0] += int(nan.sum())
            self._counts[1] += int((x == math.inf).sum())
            self._counts[2] += int((x == -math.inf).sum())
            x = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device))
        a = x.abs()
        self._max_abs = max(self._max_abs, float(a.max()))
        sq = torch.dot(x, x)
        self._sum_sq.append(sq)
        p = self.norm_type
        if p == 2.0:
            self._sum_pow.append(sq)
        elif p == 1.0:
            self._sum_pow.append(a.sum())
        elif not math.isinf(p):
            self._sum_pow.append(a.pow(p).sum())
        index = torch.arange(self.numel, self.numel + x.numel(), dtype=torch.int64, device=x.device)
        weights = ((index * _GOLDEN) % (1 << 32)).to(torch.float64) * (2.0 / (1 << 32)) - 1.0
        self._fp_sum.append(x.sum())
        self._fp_proj.append(torch.dot(x, weights))
        self.numel += x.numel()

    def result(self) -> TensorStats:
        total = lambda parts: math.fsum(float(v) for v in parts)  # noqa: E731
        sum_pow = self._max_abs if math.isinf(self.norm_type) else total(self._sum_pow)
        return TensorStats(
            numel=self.numel,
            norm_type=self.norm_type,
            sum_pow=sum_pow,
            sum_sq=total(self._sum_sq),
            max_abs=self._max_abs,
            num_nan=self._counts[0],
            num_posinf=self._counts[1],
            num_neginf=self._counts[2],
            fingerprint=(total(self._fp_sum), total(self._fp_proj)),
        )


def stats_of_chunks(chunks: Iterable["torch.Tensor"], norm_type: float) -> TensorStats:
    acc = StatsAccumulator(norm_type)
    for chunk in chunks:
        acc.add(chunk)
    return acc.result()


def stats_of_tensor(tensor: "torch.Tensor", norm_type: float, chunk_elements: int = CHUNK_ELEMENTS) -> TensorStats:
    flat = tensor.detach().reshape(-1)
    return stats_of_chunks((flat[i : i + chunk_elements] for i in range(0, flat.numel(), chunk_elements)), norm_type)
