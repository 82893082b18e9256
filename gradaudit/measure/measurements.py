"""The loss-scale rule of the dumped gradients and of the gradients before each clip call, and
dumped values read with it divided out (`piece_flat`)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from ..model import ClipCall, ClipRecord, Piece, TensorKind, TensorStats
from ..norms import divide_by_power, flags_of_stats, term_of
from ..steptable import KindColumns

if TYPE_CHECKING:
    import numpy as np

    from ..dumpfile.reader import TensorReader

SCALED_KINDS: tuple[TensorKind, ...] = ("grad", "grad_clipped")
"""Tensor kinds captured at clip time: still multiplied by the loss scale when clipping ran before unscale_."""


def gradient_scale_of(clip: ClipRecord | None) -> float:
    """How many times the true gradient the dumped gradients of a rank whose clip record is `clip`
    are (`RankDump.clip`; the guard's summary has one too): the loss scale when the rank's first
    clip call ran before GradScaler.unscale_ (the dump holds gradients "as the training had them"), else 1."""
    if clip is None:
        return 1.0
    first = clip.calls[0] if clip.calls else None
    unscaled = (
        first.unscaled if first is not None and first.unscaled is not None else clip.unscaled_before_clip
    )
    scale = first.loss_scale if first is not None and first.loss_scale is not None else clip.loss_scale
    return _loss_scale(unscaled, scale)


def _loss_scale(unscaled: bool | None, scale: float | None) -> float:
    """`scale` when the gradients were not unscaled yet and it is finite and positive, else 1."""
    return scale if unscaled is False and scale is not None and math.isfinite(scale) and scale > 0 else 1.0


def unscaled_stats(stats: TensorStats, scale: float) -> TensorStats:
    """The statistics of the gradient divided by `scale` (`gradient_scale_of`); a sum whose
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


def call_scale(call: ClipCall) -> float:
    """How many times the true gradient the gradient before this clip call was (the loss scale when
    the call ran before GradScaler.unscale_)."""
    return _loss_scale(call.unscaled, call.loss_scale)


def call_row(stats: TensorStats, norm_type: float, scale: float) -> tuple[float, ...]:
    """A piece's statistics before one clip call as a row of `call_columns`: in true-gradient scale
    (`scale`: call_scale of the call), its term of the `norm_type`-norm and that term's flags."""
    term = term_of(stats, norm_type, scale)
    unscaled = unscaled_stats(stats, scale)
    return (
        1.0,
        term or 0.0,
        flags_of_stats(stats, term),
        unscaled.sum_sq,
        unscaled.max_abs,
        stats.num_nan,
        stats.num_posinf,
        stats.num_neginf,
    )


def call_columns(rows: np.ndarray) -> tuple[KindColumns, ...]:
    """Per clip call, the step table's columns of the gradient before it, from [entries, calls, 8]
    `call_row`s (zeros where an entry holds none for a call)."""
    import numpy as np

    return tuple(
        KindColumns(
            has=c[:, 0] > 0,
            term=c[:, 1],
            flags=c[:, 2].astype(np.int8),
            sum_sq=c[:, 3],
            max_abs=c[:, 4],
            counts=c[:, 5:].astype(np.int64),
        )
        for c in np.moveaxis(rows, 1, 0)
    )


def piece_flat(
    reader: TensorReader, path: str, piece: Piece, kind: TensorKind, start: int, stop: int, scale: float = 1.0
) -> np.ndarray:
    """Elements [start, stop) of the piece's tensor `kind` as a new float64 array, unscaled."""
    import numpy as np

    values = reader.float64(path, piece.tensors[kind], start, stop)
    if scale != 1.0 and kind in SCALED_KINDS:
        with np.errstate(all="ignore"):
            values /= scale
    return values
