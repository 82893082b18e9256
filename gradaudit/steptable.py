"""The step table: every entry of a step (a measured piece of a dump) as frozen columns, the one
per-piece value the analysis and the checks read; and its row form, for a finding's message and
for tests.

Measuring builds it (`measure.table.step_table`); the diagnosis, the coefficients, the rank rows and
the checks ask it their questions as arrays, never walking the pieces one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .model import Region, TensorKind, TensorStats

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class PieceMeasurement:
    """One row of the step table: a piece of a parameter on one rank, its stats per tensor kind, and
    two-tensor products."""

    rank: int
    """The rank holding the piece."""
    index: int
    """The piece's index in its rank's file."""
    param: str
    """The logical parameter it is part of."""
    regions: tuple[Region, ...]
    """Which elements of the parameter it holds."""
    dtype: str
    """Dtype name of the dumped values (it chooses the tolerances)."""
    numel: int
    """Elements of the piece."""
    replica_group: str | None = None
    """The process group over which this piece is replicated, when the capture named one."""
    stats: Mapping[TensorKind, TensorStats] = field(default_factory=dict)
    """Tensor kind -> float64 statistics (read from the values, or as dumped in stats mode)."""
    dot_pre_post: float | None = None
    """sum(grad * grad_clipped) over elements finite in both, when both tensors were dumped with values."""
    dot_pre_pre: float | None = None
    """sum(grad * grad) over the same elements as `dot_pre_post`."""
    update_sum_sq: float | None = None
    """sum((param_after - param_before)^2) over finite elements, when both were dumped with values."""
    value_scale: float = 1.0
    """The dumped gradients were this many times the true ones (the loss scale, when they were captured
    before GradScaler.unscale_); every gradient number here is already divided by it."""

    @property
    def layout_key(self) -> tuple[object, ...]:
        return (self.param, self.regions)


@dataclass(frozen=True, kw_only=True, eq=False)
class KindColumns:
    """One tensor kind's statistics, one value per entry, the gradients' divided by their loss scale."""

    has: np.ndarray
    """bool: the entry holds statistics of this kind."""
    sum_sq: np.ndarray
    """float64: sum x^2 (0 where the entry holds none)."""
    max_abs: np.ndarray
    """float64: max |x| (0 where the entry holds none)."""
    counts: np.ndarray
    """int64 [n, 3]: nan, +inf and -inf values."""
    term: np.ndarray
    """float64: the entry's term of the step's p-norm (sum |x|^p, max |x| for the inf-norm)."""
    flags: np.ndarray
    """int8: the UNKNOWN, NAN and INF bits of `term` (norms.flags_of_stats)."""
    sum_pow: np.ndarray | None = None
    """float64: sum |x|^p, for the gradient only."""

    @property
    def nonfinite(self) -> np.ndarray:
        """int64: nonfinite values of each entry."""
        total: np.ndarray = self.counts.sum(axis=1)
        return total


@dataclass(frozen=True, kw_only=True, eq=False)
class StepTable:
    """Every entry of a step, one per row, in parameter order (then rank, then piece index): who holds
    it, what it holds, and its statistics per tensor kind. Entries with equal `layout` are replicas."""

    norm_type: float
    """`p` of the norm the statistics were taken for."""
    rank: np.ndarray
    """int: the rank holding the entry."""
    index: np.ndarray
    """int: the entry's piece index in its rank's file."""
    param: np.ndarray
    """int: the entry's parameter, an index into `param_names`."""
    param_names: Sequence[str]
    layout: np.ndarray
    """int64: equal exactly when two entries hold the same elements of the same parameter."""
    dtypes: frozenset[str]
    """The entries' dtypes (the matching tolerance reads them)."""
    grad: KindColumns
    """The gradient (before the last clip call when there were several); `term` is nan and `flags`
    UNKNOWN where the statistics cannot give the p-norm's term."""
    clipped: KindColumns | None
    """The gradient after clipping; `flags` UNKNOWN where an entry lacks it; None when none has it."""
    has_dots: np.ndarray
    """bool: the entry holds sum(pre * post) and sum(pre * pre) of its gradient (dense dumps)."""
    dot_pre_post: np.ndarray
    dot_pre_pre: np.ndarray
    has_update: np.ndarray
    """bool: the entry holds its update's sum of squares (parameters dumped before and after the step)."""
    distinct_layouts: bool
    """No two entries share a layout (no replicas)."""
    rows: Callable[[np.ndarray], Sequence[PieceMeasurement]] = field(repr=False)
    """The row form of the entries at these positions (for a message, or a test)."""

    @property
    def size(self) -> int:
        return int(self.rank.size)

    @property
    def has_clipped(self) -> np.ndarray:
        import numpy as np

        return self.clipped.has if self.clipped is not None else np.zeros(self.size, dtype=bool)

    @functools.cached_property
    def by_rank_order(self) -> np.ndarray:
        """The positions in (rank, index) order."""
        import numpy as np

        order: np.ndarray = np.lexsort((self.index, self.rank))
        return order

    @functools.cached_property
    def cover(self) -> np.ndarray:
        """The disjoint cover: each layout's lowest (rank, index) entry, in that order."""
        import numpy as np

        order = self.by_rank_order
        if self.distinct_layouts:  # every entry is its layout's only copy
            return order
        _, first = np.unique(self.layout[order], return_index=True)  # a stable sort: the first occurrence
        found: np.ndarray = order[np.sort(first)]
        return found
