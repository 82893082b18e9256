"""Reading an unsharded reference step region by region, and comparing values with it (numpy)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..dumpfile.dump import StepDump
from ..model import Box, FlatRange, Piece, Region, TensorKind, numel_of

if TYPE_CHECKING:
    from ..dumpfile.reader import TensorReader
    from ..steptable import DenseUpdate


def compare_values(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float, int]:
    """(max |ours - ref| over elements finite in both, max |ref| over its finite elements, count of
    elements where one is finite and the other not, or both nonfinite but not the same value)."""
    if ours.size == 0:
        return 0.0, 0.0, 0
    with np.errstate(all="ignore"):
        ours_finite, ref_finite = np.isfinite(ours), np.isfinite(ref)
        if ours_finite.all() and ref_finite.all():
            return float(np.abs(ours - ref).max()), float(np.abs(ref).max()), 0
        both = ours_finite & ref_finite
        diff = np.abs(np.where(both, ours - ref, 0.0))
        ref_abs = np.abs(np.where(ref_finite, ref, 0.0))
        same_nonfinite = ~ours_finite & ~ref_finite & ((ours == ref) | (np.isnan(ours) & np.isnan(ref)))
        mismatch = int(np.count_nonzero(~both & ~same_nonfinite))
        return float(diff.max()), float(ref_abs.max()), mismatch


class ReferenceSource:
    """Values of one parameter's tensor kind in the reference dump, in float64, by region.

    A reference piece holding the whole parameter is read row range by row range from its file; any
    other cover of the parameter (a sharded reference) is assembled densely in memory first
    (references are small models). `pieces`: (path, piece) of the reference's pieces that hold
    `kind`'s values. Values are divided by `scale` (a loss scale still in them).
    """

    def __init__(
        self,
        reader: TensorReader,
        global_shape: tuple[int, ...],
        pieces: list[tuple[str, Piece]],
        kind: TensorKind,
        scale: float = 1.0,
    ) -> None:
        self.reader = reader
        self.global_shape = tuple(global_shape)
        self.kind = kind
        self.scale = scale
        self.whole: tuple[str, Piece] | None = None
        self.dense: np.ndarray | None = None
        for path, piece in pieces:
            if is_whole(piece.regions, self.global_shape):
                self.whole = (path, piece)
                return
        self.dense = assemble_dense(reader, self.global_shape, pieces, kind)

    def flat(self, start: int, stop: int) -> np.ndarray:
        """Elements [start, stop) of the row-major flattened parameter."""
        if self.whole is not None:
            path, piece = self.whole
            values = self.reader.float64(path, piece.tensors[self.kind], start, stop)
        else:
            assert self.dense is not None
            values = self.dense.reshape(-1)[start:stop]
        return values / self.scale if self.scale != 1.0 else values

    def box(self, offsets: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
        """The box's elements, row-major: the whole rows that hold it are read, then cut."""
        if len(shape) == 0:
            return self.flat(0, 1)
        index = tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=False))
        inner = numel_of(self.global_shape[1:])
        rows = self.flat(offsets[0] * inner, (offsets[0] + shape[0]) * inner)
        return rows.reshape((shape[0],) + self.global_shape[1:])[(slice(None),) + index[1:]].reshape(-1)


def is_whole(regions: tuple[Region, ...], global_shape: tuple[int, ...]) -> bool:
    if len(regions) != 1:
        return False
    region = regions[0]
    if isinstance(region, FlatRange):
        return region.start == 0 and region.stop == numel_of(global_shape)
    return all(o == 0 for o in region.offsets) and tuple(region.shape) == tuple(global_shape)


def covers(pieces: list[tuple[str, Piece]], global_shape: tuple[int, ...]) -> bool:
    """Whether the distinct layouts hold at least as many elements as the parameter (a cheap test)."""
    layouts = {piece.regions for _, piece in pieces}
    return sum(sum(r.numel for r in regions) for regions in layouts) >= numel_of(global_shape)


def assemble_dense(
    reader: TensorReader, global_shape: tuple[int, ...], pieces: list[tuple[str, Piece]], kind: TensorKind
) -> np.ndarray:
    dense = np.full((numel_of(global_shape),), math.nan, dtype=np.float64)
    flat_index = np.arange(numel_of(global_shape)).reshape(global_shape)
    for path, piece in pieces:
        key = piece.tensors[kind]
        values = reader.float64(path, key, 0, math.prod(reader.entry(path, key).shape))
        offset = 0
        for region in piece.regions:
            if isinstance(region, FlatRange):
                dense[region.start : region.stop] = values[offset : offset + region.numel]
            else:
                index = flat_index[
                    tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape, strict=False))
                ].reshape(-1)
                dense[index] = values[offset : offset + region.numel]
            offset += region.numel
    return dense.reshape(global_shape)


def region_windows(region: Region, chunk: int, row_elements: int = 0) -> Iterator[tuple[Region, int]]:
    """Sub-regions of at most about `chunk` elements, each with its element offset inside the region.

    A box is cut into runs of rows; `row_elements` (a whole row of the parameter, which is what the
    reference reads for a box) keeps those reads near `chunk` elements too."""
    if isinstance(region, FlatRange):
        for start in range(0, region.numel, chunk):
            stop = min(region.numel, start + chunk)
            yield FlatRange(start=region.start + start, stop=region.start + stop), start
        return
    if len(region.shape) == 0 or region.numel == 0:
        yield region, 0
        return
    inner = numel_of(region.shape[1:])
    rows_per_chunk = max(1, chunk // max(inner, row_elements, 1))
    for row in range(0, region.shape[0], rows_per_chunk):
        rows = min(rows_per_chunk, region.shape[0] - row)
        sub = Box(offsets=(region.offsets[0] + row,) + region.offsets[1:], shape=(rows,) + region.shape[1:])
        yield sub, row * inner


def compare_regions(
    read_ours: Callable[[int, int], np.ndarray],
    regions: tuple[Region, ...],
    source: ReferenceSource,
    chunk: int,
) -> tuple[float, float, int, int]:
    """Compare a piece (its elements [a, b) in float64 from `read_ours(a, b)`) with the reference, window
    by window: (max |error|, max |reference|, nonfinite mismatches, elements compared)."""
    max_err, max_ref, mismatches, compared = 0.0, 0.0, 0, 0
    region_offset = 0
    row_elements = numel_of(source.global_shape[1:]) if source.global_shape else 1
    for region in regions:
        for sub, offset in region_windows(region, chunk, row_elements):
            start = region_offset + offset
            ours = read_ours(start, start + sub.numel)
            ref = (
                source.flat(sub.start, sub.stop)
                if isinstance(sub, FlatRange)
                else source.box(sub.offsets, sub.shape)
            )
            err, ref_max, mismatch = compare_values(ours, ref)
            max_err, max_ref, mismatches = max(max_err, err), max(max_ref, ref_max), mismatches + mismatch
            compared += sub.numel
        region_offset += region.numel
    return max_err, max_ref, mismatches, compared


def dense_updates(
    step: StepDump, reference: StepDump, reader: TensorReader, grad_kinds: Mapping[str, TensorKind]
) -> dict[str, DenseUpdate]:
    """Parameter -> its dense next weights here and, in the reference, its weights before and after
    the step and its gradient (of `grad_kinds[name]`, the loss scale divided out), for each parameter
    both dumps hold with values whole (ours may leave elements nan: not covered, left to GA603)."""
    from ..steptable import DenseUpdate
    from .table import piece_table

    if not grad_kinds:
        return {}
    ref_table, our_table = piece_table(reference, grad_kinds), piece_table(step, grad_kinds)
    found = {}
    for name, grad_kind in grad_kinds.items():
        shape = tuple(reference.params[name].global_shape)
        ref_pieces = [(path, piece) for _, path, piece in ref_table.cover(name)]
        ours = [(path, piece) for _, path, piece in our_table.cover(name)]
        needed: tuple[TensorKind, ...] = ("param_before", "param_after", grad_kind)
        if not all(all(k in p.tensors for _, p in ref_pieces) and ref_pieces for k in needed):
            continue
        if not ours or not all("param_after" in p.tensors for _, p in ours):
            continue
        dense = {k: assemble_dense(reader, shape, ref_pieces, k) for k in needed}
        ours_after = assemble_dense(reader, shape, ours, "param_after")
        if bool(np.isnan(ours_after).any()) and not bool(np.isnan(dense["param_after"]).any()):
            continue  # our pieces do not cover the parameter: leave it to GA603
        found[name] = DenseUpdate(
            ours_after=ours_after,
            ref_before=dense["param_before"],
            ref_after=dense["param_after"],
            ref_grad=dense[grad_kind] / _scale(reference, grad_kind),
        )
    return found


def _scale(step: StepDump, kind: TensorKind) -> float:
    from .measurements import SCALED_KINDS, gradient_scale_of

    if kind not in SCALED_KINDS or not step.ranks_present:
        return 1.0
    return gradient_scale_of(step.ranks[step.ranks_present[0]].clip)  # finite and positive
