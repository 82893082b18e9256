"""The loss-scale rule of the dumped gradients, and a piece's measurement (a row of the step table)
from its statistics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from ..model import ClipRecord, Piece, RankDump, TensorKind, TensorStats
from ..norms import divide_by_power
from ..steptable import PieceMeasurement

if TYPE_CHECKING:
    import numpy as np

SCALED_KINDS: tuple[TensorKind, ...] = ("grad", "grad_clipped")
"""Tensor kinds captured at clip time: still multiplied by the loss scale when clipping ran before unscale_."""


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
