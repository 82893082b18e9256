"""The check's inner loop: float64 statistics of dumped tensors, read chunk by chunk into reused buffers.

One `ChunkKernel` per worker thread. Each chunk is read from the file (no memory map), widened into
one of the kernel's reused float64 buffers and reduced there: a sum of squares and a min/max,
nothing else allocated per chunk. The common case, all values finite, is recognised from the sum of
squares itself (a nan or inf makes it non-finite); only then are the nonfinite values counted and
masked (in a copy).

Results depend only on the chunk size and the values, never on the number of workers or their
order: torch runs single-threaded inside each worker (see `single_threaded_torch`), so the same dump
gives the same bits whichever way the parameters were spread.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .model import TensorStats
from .tensorstats import StatsAccumulator

if TYPE_CHECKING:
    import torch

    from .dumpfile import TensorReader
    from .model import Piece

KERNEL_CHUNK_ELEMENTS = 1 << 19
"""512K elements (a 4 MiB float64 buffer): large enough that the Python around each chunk is a small
share, small enough to stay in cache between the passes over it (measured: 256K and 1M are slower)."""


class ChunkKernel:
    """Reusable float64 buffers (one per tensor kind) and the reductions of one worker."""

    def __init__(self, chunk_elements: int = KERNEL_CHUNK_ELEMENTS) -> None:
        self.chunk_elements = chunk_elements
        self._buffers: dict[str, torch.Tensor] = {}

    def windows(self, numel: int) -> Iterator[tuple[int, int]]:
        for start in range(0, numel, self.chunk_elements):
            yield start, min(numel, start + self.chunk_elements)

    def widen(self, values: torch.Tensor, slot: str) -> torch.Tensor:
        """`values` (any float dtype, at most one chunk) as float64, in the reused buffer `slot`."""
        import torch

        buffer = self._buffers.get(slot)
        if buffer is None:
            buffer = self._buffers[slot] = torch.empty(self.chunk_elements, dtype=torch.float64)
        wide = buffer[: values.numel()]
        wide.copy_(values.reshape(-1))
        return wide

    def read_piece(
        self,
        reader: TensorReader,
        path: str,
        piece: Piece,
        norm_type: float,
        *,
        fingerprint: bool = False,
    ) -> tuple[dict[str, TensorStats], float | None, float | None, float | None]:
        """One pass over every tensor the piece holds, in aligned chunks: ({kind: TensorStats},
        sum grad*grad_clipped, sum grad*grad, sum (param_after - param_before)^2), the sums over the
        elements finite in both tensors of the pair (None when the pair was not dumped).

        The fingerprint (a weighted sum per element position) is computed only when asked for:
        replicas with values are compared by value, so only a replica set that mixes values with
        stats-only copies needs it."""
        kinds = sorted(piece.tensors)
        numel = piece.numel
        if fingerprint:
            accumulators = {kind: StatsAccumulator(norm_type) for kind in kinds}
        sums = {kind: _Sums(norm_type) for kind in kinds}
        pre_post = "grad" in piece.tensors and "grad_clipped" in piece.tensors
        update = "param_before" in piece.tensors and "param_after" in piece.tensors
        pairs: dict[str, list[float]] = {"pre_post": [], "pre_pre": [], "update": []}
        for start, stop in self.windows(numel):
            wide = {}
            for kind in kinds:
                values = reader.read_range(path, piece.tensors[kind], start, stop)
                if fingerprint:
                    accumulators[kind].add(values)
                wide[kind] = self.widen(values, kind)
                sums[kind].add(wide[kind], values)
            if pre_post:
                ab, aa, _ = _finite_products(wide["grad"], wide["grad_clipped"], difference=False)
                pairs["pre_post"].append(ab)
                pairs["pre_pre"].append(aa)
            if update:
                pairs["update"].append(
                    _finite_products(wide["param_before"], wide["param_after"], difference=True)[2]
                )
        if fingerprint:
            stats = {kind: acc.result() for kind, acc in accumulators.items()}
        else:
            stats = {kind: s.result(numel) for kind, s in sums.items()}
        total = lambda key, wanted: math.fsum(pairs[key]) if wanted else None  # noqa: E731
        return stats, total("pre_post", pre_post), total("pre_pre", pre_post), total("update", update)


def _finite_products(a: torch.Tensor, b: torch.Tensor, *, difference: bool) -> tuple[float, float, float]:
    """(a.b, a.a, |b-a|^2) over the elements finite in both; the buffers are left unchanged."""
    import torch

    if difference:
        d = b - a
        dd = float(torch.dot(d, d))
        if math.isfinite(dd):
            return 0.0, 0.0, dd
    else:
        ab, aa = float(torch.dot(a, b)), float(torch.dot(a, a))
        if math.isfinite(ab) and math.isfinite(aa) and math.isfinite(float(torch.dot(b, b))):
            return ab, aa, 0.0
    both = torch.isfinite(a) & torch.isfinite(b)
    zero = torch.zeros((), dtype=torch.float64)
    a, b = torch.where(both, a, zero), torch.where(both, b, zero)
    d = b - a
    return float(torch.dot(a, b)), float(torch.dot(a, a)), float(torch.dot(d, d))


class _Sums:
    """Running float64 sums of one tensor's chunks (finite values only), without a fingerprint."""

    def __init__(self, norm_type: float) -> None:
        self.norm_type = float(norm_type)
        self.sum_sq: list[float] = []
        self.sum_pow: list[float] = []
        self.max_abs = 0.0
        self.counts = [0, 0, 0]

    def add(self, wide: torch.Tensor, raw: torch.Tensor | None = None) -> None:
        """Add one chunk (float64; left unchanged). `raw` is the same chunk as dumped: its min and max
        are the same numbers and cheaper to find in the narrower dtype."""
        import torch

        if wide.numel() == 0:
            return
        sq = float(torch.dot(wide, wide))
        extremes = raw.reshape(-1) if raw is not None and raw.element_size() in (2, 4) else wide  # not float8
        if not math.isfinite(sq):
            extremes = wide
            finite = torch.isfinite(wide)
            if not bool(finite.all()):
                self.counts[0] += int(torch.isnan(wide).sum())
                self.counts[1] += int((wide == math.inf).sum())
                self.counts[2] += int((wide == -math.inf).sum())
                wide = torch.where(finite, wide, torch.zeros((), dtype=wide.dtype))
                sq = float(torch.dot(wide, wide))
            extremes = wide
        low, high = torch.aminmax(extremes)
        self.max_abs = max(self.max_abs, -float(low), float(high))
        self.sum_sq.append(sq)
        p = self.norm_type
        if p == 2.0:
            self.sum_pow.append(sq)
        elif p == 1.0:
            self.sum_pow.append(float(torch.linalg.vector_norm(wide, 1)))
        elif not math.isinf(p):
            self.sum_pow.append(float(wide.abs().pow_(p).sum()))

    def result(self, numel: int) -> TensorStats:
        return TensorStats(
            numel=numel,
            norm_type=self.norm_type,
            sum_pow=self.max_abs if math.isinf(self.norm_type) else math.fsum(self.sum_pow),
            sum_sq=math.fsum(self.sum_sq),
            max_abs=self.max_abs,
            num_nan=self.counts[0],
            num_posinf=self.counts[1],
            num_neginf=self.counts[2],
        )


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """torch's own intra-op threads off while workers run (they would fight the workers for the cores,
    and a reduction split over a different number of threads rounds differently)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
