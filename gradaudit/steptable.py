"""What measuring a step gives, the values the analysis and the checks read: the step table (every
entry of a step, a measured piece of a dump or an ownership group of the guard, as frozen columns),
the replica comparisons and the comparisons with a reference.

Measuring builds them from files (`measure.measure_step`, `measure.table.step_table`), the guard from
its gathered numbers (`live.analysis_input`); the diagnosis, the coefficients, the rank rows and the
checks ask the table their questions as arrays, never walking the pieces one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .model import Region, TensorKind

if TYPE_CHECKING:
    import numpy as np


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
    """The step's parameters (the guard's: its ownership groups), by id."""
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
    """float64: sum(pre * post) over elements finite in both (0 where not held), loss scale divided out."""
    dot_pre_pre: np.ndarray
    """float64: sum(pre * pre) over the same elements."""
    has_update: np.ndarray
    """bool: the entry holds its update's sum of squares (parameters dumped before and after the step)."""
    update_sum_sq: np.ndarray
    """float64: sum((param_after - param_before)^2) over finite elements (0 where not held)."""
    numel: np.ndarray
    """int64: elements of the entry."""
    distinct_layouts: bool
    """No two entries share a layout (no replicas)."""
    calls: tuple[KindColumns, ...] = ()
    """Per clip call, when a rank made two or more and its entries hold per-call statistics: the
    gradient just before it, in true-gradient scale (the loss scale divided out of a call that ran
    before GradScaler.unscale_); `has` false where an entry holds none for that call."""

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


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaCopy:
    """One copy of a replica set compared with the set's base (lowest-rank) copy."""

    rank: int
    """The rank holding this copy."""
    index: int
    """The copy's piece index in that rank's file."""
    max_abs_diff: float | None = None
    """Largest |copy - base| over elements finite in both (None in stats mode)."""
    num_nonfinite_mismatch: int | None = None
    """Elements where one is finite and the other not, or both infinite with different signs."""
    fingerprint_delta: float | None = None
    """Largest difference of the fingerprint components (stats mode)."""
    param_max_abs_diff: float | None = None
    """Largest |copy - base| of the parameter values the optimizer step started from (`param_before`),
    when every copy has them: replicas whose weights drifted apart (None when not recorded)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSet:
    """Pieces with one layout (same parameter, same regions) held on several ranks."""

    param: str
    """The logical parameter."""
    regions: tuple[Region, ...]
    """The elements every copy holds."""
    dtype: str
    """Dtype name of the base copy."""
    base_rank: int
    """The lowest rank holding a copy: the one every norm counts."""
    base_index: int
    """The base copy's piece index in its rank's file."""
    base_max_abs: float
    """max |x| of the base copy's gradient (the scale the differences are judged against)."""
    base_sum_sq: float
    """sum(x^2) of the base copy's gradient."""
    numel: int
    """Elements of each copy."""
    copies: tuple[ReplicaCopy, ...]
    """Every other copy, compared with the base."""
    by_values: bool
    """True when the copies were compared value by value, False when only by fingerprints."""
    param_base_max_abs: float | None = None
    """max |param_before| of the base copy, when the copies' parameters were compared."""

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({self.base_rank, *(c.rank for c in self.copies)}))


@dataclass(frozen=True, kw_only=True)
class ReferenceDifference:
    """One parameter and tensor kind compared with the reference, element by element."""

    param: str
    """The logical parameter."""
    kind: TensorKind
    """The tensor kind compared (grad, grad_clipped or param_after)."""
    dtype: str
    """The dumped dtype: it chooses the tolerance."""
    numel_compared: int
    """Elements compared (those of our pieces)."""
    max_abs_error: float
    """max |ours - reference| over elements finite in both."""
    max_abs_reference: float
    """max |reference| over the compared elements (the relative tolerance's scale)."""
    num_nonfinite_mismatch: int = 0
    """Elements nonfinite in one of the two only."""


@dataclass(frozen=True, kw_only=True)
class ParamMeasurement:
    """One logical parameter: all its pieces on all present ranks, measured."""

    param: str
    """The logical parameter."""
    norm_type: float
    """`p` of the norm the statistics were taken for."""
    replica_sets: tuple[ReplicaSet, ...] = ()
    """Its layouts held on two or more ranks, compared copy by copy."""
    reference_errors: tuple[ReferenceDifference, ...] = ()
    """Per tensor kind, the comparison with the reference (empty without one)."""
    notes: tuple[str, ...] = ()
    """Why something about this parameter could not be measured (e.g. absent from the reference)."""


@dataclass(frozen=True, kw_only=True)
class StepMeasurements:
    """Everything read from the tensors of one step; a pure value the checks work on."""

    norm_type: float
    """`p` of the norm the statistics were taken for (the recorded clipping's, else 2)."""
    params: Mapping[str, ParamMeasurement]
    """Parameter name -> its measurement, sorted by name."""
    table: StepTable
    """Every measured piece of the parameters, as the step table."""
    reference_table: StepTable | None = None
    """The reference dump's pieces of the parameters compared with it (their stats), with a reference."""
    reference_given: bool = False
    """Whether an unsharded reference step was compared (--reference)."""
    reference_step: int | None = None
    """The reference's step number; None without a reference."""
    reference_only_params: tuple[str, ...] = ()
    """Parameters the reference holds and the checked dump does not."""


@dataclass(frozen=True, kw_only=True, eq=False)
class DenseUpdate:
    """One parameter's dense float64 arrays (its global shape) that judging its next weights through
    the optimizer reads (analysis.updates), read once with a reference."""

    ours_after: np.ndarray
    """The checked dump's next weights (nan where its pieces hold none)."""
    ref_before: np.ndarray
    """The reference's weights before the optimizer step."""
    ref_after: np.ndarray
    """The reference's next weights."""
    ref_grad: np.ndarray
    """The reference's gradient the step used, the loss scale divided out."""
