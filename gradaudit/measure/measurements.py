"""What reading a step's tensors gives (the values measure_step returns and the checks read): per
piece statistics, replica comparisons, comparisons with a reference, and the loss-scale rule of
the dumped gradients."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..model import ClipRecord, Piece, RankDump, Region, TensorKind, TensorStats
from ..norms import divide_by_power
from ..steptable import PieceMeasurement

if TYPE_CHECKING:
    import numpy as np

SCALED_KINDS: tuple[TensorKind, ...] = ("grad", "grad_clipped")
"""Tensor kinds captured at clip time: still multiplied by the loss scale when clipping ran before unscale_."""


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
    pieces: Sequence[PieceMeasurement]
    """Its rows of the step's table (a table.TablePieces: each built when indexed or iterated)."""
    replica_sets: tuple[ReplicaSet, ...] = ()
    """Its layouts held on two or more ranks, compared copy by copy."""
    reference_pieces: Sequence[PieceMeasurement] = ()
    """The reference dump's pieces of this parameter (their stats), when a reference was given."""
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
    reference_given: bool = False
    """Whether an unsharded reference step was compared (--reference)."""
    reference_step: int | None = None
    """The reference's step number; None without a reference."""
    reference_only_params: tuple[str, ...] = ()
    """Parameters the reference holds and the checked dump does not."""

    def merge(self, other: StepMeasurements) -> StepMeasurements:
        """Combine measurements of disjoint parameter subsets of the same step."""
        if self.norm_type != other.norm_type and not (
            math.isnan(self.norm_type) and math.isnan(other.norm_type)
        ):
            raise ValueError(
                f"cannot merge measurements of norm types {self.norm_type} and {other.norm_type}"
            )
        if self.reference_given != other.reference_given:
            raise ValueError("cannot merge measurements with and without a reference")
        overlap = set(self.params) & set(other.params)
        if overlap:
            raise ValueError(
                f"cannot merge measurements that both hold {sorted(overlap)[:3]}; split parameters disjointly"
            )
        params = dict(sorted({**self.params, **other.params}.items()))
        pieces = [cast("Any", pm.pieces) for pm in (*self.params.values(), *other.params.values())]
        tables = list({id(p.table): p.table for p in pieces}.values())
        if tables:  # one table of both, the pieces of each parameter its rows
            table = functools.reduce(lambda a, b: a.merged(b), tables)
            params = {
                name: replace(pm, pieces=table.pieces(table.param_positions(name)))
                for name, pm in params.items()
            }
        return StepMeasurements(
            norm_type=self.norm_type,
            params=params,
            reference_given=self.reference_given,
            reference_step=self.reference_step,
            reference_only_params=tuple(
                sorted(set(self.reference_only_params) | set(other.reference_only_params))
            ),
        )

    @property
    def pieces(self) -> Iterator[PieceMeasurement]:
        for pm in self.params.values():
            yield from pm.pieces


def dumped_gradient_scale(dump: RankDump) -> float:
    """How many times the true gradient the dumped gradients are: the loss scale when the rank's first
    clip call ran before GradScaler.unscale_ (the dump holds gradients "as the training had them"), else 1."""
    return gradient_scale_of(dump.clip)


def gradient_scale_of(clip: ClipRecord | None) -> float:
    """`dumped_gradient_scale` of a rank whose clip record is `clip` (the guard's summary has one too)."""
    if clip is None:
        return 1.0
    first = clip.calls[0] if clip.calls else None
    unscaled = (
        first.unscaled if first is not None and first.unscaled is not None else clip.unscaled_before_clip
    )
    scale = first.loss_scale if first is not None and first.loss_scale is not None else clip.loss_scale
    if unscaled is False and scale is not None and math.isfinite(scale) and scale > 0:
        return scale
    return 1.0


def unscaled_stats(stats: TensorStats, scale: float) -> TensorStats:
    """The statistics of the gradient divided by `scale` (`dumped_gradient_scale`); a sum whose
    quotient is beyond float64 becomes inf or 0 (as the float64 sum of the unscaled values would),
    never an exception."""
    if scale == 1.0:
        return stats
    sum_pow, sum_sq, max_abs = unscaled_sums(
        stats.sum_pow, stats.sum_sq, stats.max_abs, scale, stats.norm_type
    )
    return replace(
        stats,
        sum_pow=sum_pow,
        sum_sq=sum_sq,
        max_abs=max_abs,
        fingerprint=tuple(v / scale for v in stats.fingerprint),
    )


_F = TypeVar("_F", float, "np.ndarray")


def unscaled_sums(sum_pow: _F, sum_sq: _F, max_abs: _F, scale: float, norm_type: float) -> tuple[_F, _F, _F]:
    """(sum |x|^p, sum x^2, max |x|) of the values divided by `scale`, from those of the values
    (taken for `norm_type`): floats, or the columns of many pieces. The one loss-scale rule of sums."""
    return (
        sum_pow / scale if math.isinf(norm_type) else divide_by_power(sum_pow, scale, norm_type),
        divide_by_power(sum_sq, scale, 2.0),
        max_abs / scale,
    )


def piece_measurement(
    rank: int,
    piece: Piece,
    scale: float = 1.0,
    *,
    stats: Mapping[TensorKind, TensorStats] | None = None,
    products: tuple[float | None, float | None, float | None] = (None, None, None),
) -> PieceMeasurement:
    """The measurement of a piece: its statistics (`stats`, by default those it holds: a piece with
    statistics only has nothing to read), its gradient's divided by `scale`; `products`: its
    dot_pre_post, dot_pre_pre and update_sum_sq, read from its values (already unscaled)."""
    stats = piece.stats if stats is None else stats
    if scale != 1.0:
        stats = {k: unscaled_stats(v, scale) if k in SCALED_KINDS else v for k, v in stats.items()}
    return PieceMeasurement(
        rank=rank,
        index=piece.index,
        param=piece.param,
        regions=piece.regions,
        dtype=piece.dtype,
        numel=math.prod(piece.local_shape),
        replica_group=piece.replica_group,
        stats=dict(sorted(stats.items())) if len(stats) > 1 else stats,
        dot_pre_post=products[0],
        dot_pre_pre=products[1],
        update_sum_sq=products[2],
        value_scale=scale,
    )
