"""Stats-only pieces measured as columns: one table for the whole step instead of a
PieceMeasurement per piece (millions of them in a many-rank stats dump).

A piece with statistics only has nothing to read: its measurement is its stored statistics, the
gradient's divided by its rank's loss scale (`dumped_gradient_scale`, when the dump holds them
before unscale_). The table keeps each rank's ColumnarPieces and, step-wide, the parameter, rank,
index and layout of every piece; a PieceMeasurement is built only for the pieces a caller asks for
(a finding that names a few, the copies of a replicated layout).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from ..dumpfile.columnar import ColumnarPieces, ParamIds
from ..model import Piece, Region, StepDump, TensorKind
from .measurements import (
    SCALED_KINDS,
    PieceMeasurement,
    ReplicaCopy,
    ReplicaSet,
    dumped_gradient_scale,
    piece_measurement,
    unscaled_sums,
)

_BATCH = 1024


class PieceTable:
    """Every piece of the chosen parameters on the step's stats-only ranks, by parameter (in the
    order of `names`), then rank, then piece index: position `p` is piece `index[p]` of rank
    `rank[p]`, and a parameter's pieces are the positions `bounds[name]`."""

    def __init__(
        self,
        sources: Sequence[tuple[int, str, ColumnarPieces]],
        names: Sequence[str],
        wanted: Iterable[str],
        scales: Sequence[float] = (),
    ) -> None:
        self.sources = tuple(sources)
        self.scales = tuple(scales) or (1.0,) * len(self.sources)
        """Per source, `dumped_gradient_scale` of its rank: its gradients' columns are divided by it."""
        self.kinds = tuple(sorted(sources[0][2].kinds))
        self.norm_type = sources[0][2].norm_type
        self._source_of = {rank: k for k, (rank, _, _) in enumerate(sources)}
        ids = ParamIds(names)
        per_source = [ids.of(pieces).astype(np.int32) for _, _, pieces in sources]
        self.names = list(ids.ids)
        keep = np.zeros(len(self.names), dtype=bool)
        keep[[ids.ids[name] for name in wanted]] = True
        self._chosen: list[np.ndarray | None] = []
        """Per source, the local indices of the pieces kept (None: all)."""
        for param in per_source:
            kept = keep[param]
            self._chosen.append(None if kept.all() else np.flatnonzero(kept))
        sizes = np.array(
            [_count(c, p) for c, p in zip(self._chosen, per_source, strict=True)], dtype=np.int64
        )
        self.size = int(sizes.sum())
        param = np.concatenate([_take(p, c) for p, c in zip(per_source, self._chosen, strict=True)])
        self._order = np.argsort(param, kind="stable")
        """Rank-major position (the ranks' columns one after the other) of each position."""
        self.param = param[self._order]
        del param
        self.rank = np.repeat(np.array([rank for rank, _, _ in sources], dtype=np.int32), sizes)[self._order]
        self.index = np.concatenate(
            [
                np.arange(len(p), dtype=np.int32) if c is None else c.astype(np.int32)
                for p, c in zip(per_source, self._chosen, strict=True)
            ]
        )[self._order]
        del per_source
        dtypes: dict[str, int] = {}
        codes: list[np.ndarray] = []
        seen: tuple[object, np.ndarray] = ((), np.zeros(0, dtype=np.int16))
        for _, _, pieces in sources:
            if not (seen[0] is pieces.params or seen[0] == pieces.params):
                table = [dtypes.setdefault(p.dtype, len(dtypes)) for p in pieces.params]
                seen = (pieces.params, np.array(table, dtype=np.int16))
            codes.append(seen[1])
        self.dtype = self._gather(lambda k, pieces: codes[k][pieces.rows[:, 0]])
        self.dtype_names = list(dtypes)
        bounds = np.searchsorted(self.param, np.arange(len(self.names) + 1))
        self.bounds = {name: (int(bounds[i]), int(bounds[i + 1])) for i, name in enumerate(self.names)}
        self.layout = self._layouts()
        self.copies = np.bincount(self.layout) if self.size else np.zeros(0, dtype=np.int64)
        """Pieces holding each layout: more than one are replicas."""

    def _gather(self, column: Callable[[int, ColumnarPieces], np.ndarray]) -> np.ndarray:
        """`column(k, pieces)` of every source `k`, rows kept only, in position order."""
        parts = [_take(column(k, pieces), self._chosen[k]) for k, (_, _, pieces) in enumerate(self.sources)]
        if not parts:
            return np.zeros(0)
        return np.concatenate(parts)[self._order]

    def _layouts(self) -> np.ndarray:
        """A number per position, equal exactly when the pieces' layout keys are."""
        if not self.size:
            return np.zeros(0, dtype=np.int64)
        width = max(pieces.layout_width for _, _, pieces in self.sources)
        keys = [self.param] + [self._gather(_layout_column(column, width)) for column in range(1, 2 + width)]
        order = _sorting(keys)
        starts = np.zeros(self.size, dtype=bool)
        starts[0] = True
        for key in keys:
            ordered = key[order]
            starts[1:] |= ordered[1:] != ordered[:-1]
        del keys
        layout = np.empty(self.size, dtype=np.int64)
        layout[order] = np.cumsum(starts) - 1
        return layout

    def all_sources(self, test: Callable[[ColumnarPieces], bool]) -> bool:
        """Whether `test` holds for every rank's columns (all their pieces, kept or not)."""
        return all(test(pieces) for _, _, pieces in self.sources)

    def kind_column(self, kind: TensorKind, column: int) -> np.ndarray:
        """Column `column` of every position's `kind` statistics (0 sum_pow, 1 sum_sq, 2 max_abs)."""
        return self._gather(lambda k, pieces: self._unscaled(k, kind, pieces)[:, column])

    def _unscaled(self, source: int, kind: TensorKind, pieces: ColumnarPieces) -> np.ndarray:
        """The `kind` statistics of one source, its gradients divided by its loss scale."""
        values, scale = pieces.stats[kind], self.scales[source]
        if scale == 1.0 or kind not in SCALED_KINDS:
            return values
        out = values / scale  # max |x| and the fingerprint
        out[:, 0], out[:, 1], out[:, 2] = unscaled_sums(
            values[:, 0], values[:, 1], values[:, 2], scale, self.norm_type
        )
        return out

    def kind_counts(self, kind: TensorKind) -> np.ndarray:
        """[n, 3] nonfinite counts (nan, +inf, -inf) of every position's `kind`."""
        return self._gather(lambda _, pieces: pieces.counts[kind])

    def param_positions(self, name: str) -> range:
        return range(*self.bounds.get(name, (0, 0)))

    def entries(self, positions: Sequence[int] | np.ndarray) -> list[tuple[int, str, Piece]]:
        """(rank, file path, piece) at each position, the piece built from its rank's columns."""
        positions = np.asarray(positions, dtype=np.int64)
        ranks, indices = self.rank[positions], self.index[positions]
        found: list[tuple[int, str, Piece] | None] = [None] * positions.size
        by_rank = np.argsort(ranks, kind="stable")
        distinct, starts = np.unique(ranks[by_rank], return_index=True)
        bounds = [*starts.tolist(), positions.size]
        for k, rank in enumerate(distinct.tolist()):
            at = by_rank[bounds[k] : bounds[k + 1]]
            _, path, pieces = self.sources[self._source_of[rank]]
            for i, piece in zip(at.tolist(), pieces.build(indices[at].tolist()), strict=True):
                found[i] = (rank, path, piece)
        return [entry for entry in found if entry is not None]

    def measurements(self, positions: Sequence[int] | np.ndarray) -> list[PieceMeasurement]:
        """The PieceMeasurement of each position, as _measure_piece gives for a stats-only piece."""
        scales = self.scales
        return [
            piece_measurement(rank, piece, scales[self._source_of[rank]])
            for rank, _, piece in self.entries(positions)
        ]

    @functools.cached_property
    def _grad_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """sum_sq, max_abs, fingerprint [n, f] and nonfinite count of every position's gradient
        (gathered once, when the step has replicas to compare)."""
        stats = self._gather(lambda k, pieces: self._unscaled(k, "grad", pieces))
        counts = self._gather(lambda _, pieces: pieces.counts["grad"]).sum(axis=1)
        return stats[:, 1], stats[:, 2], stats[:, 3:], counts

    @functools.cached_property
    def _set_bases(self) -> dict[int, tuple[str, tuple[Region, ...], str, int]]:
        """Layout -> (param, regions, dtype, numel) of its lowest (rank, index) copy, for every
        replicated layout of the step: built at once, one call per rank, and only these kept."""
        replicated = np.flatnonzero(self.copies[self.layout] > 1)
        order = np.lexsort((self.index[replicated], self.rank[replicated]))
        bases = replicated[lowest_copies(self.layout[replicated], order)]
        return {
            layout_id: (piece.param, piece.regions, piece.dtype, piece.numel)
            for layout_id, (_, _, piece) in zip(self.layout[bases].tolist(), self.entries(bases), strict=True)
        }

    def replica_sets(self, positions: np.ndarray) -> tuple[ReplicaSet, ...] | None:
        """The replica sets of these replicated positions compared by fingerprint, as
        measure._compare_replicas gives them for stats-only copies, from the columns: objects only
        for each set's base piece and its copies' results. None when the pieces hold no gradient
        statistics (the object path then says so per copy)."""
        if "grad" not in self.kinds or not positions.size:
            return None
        layout, rank, index = self.layout[positions], self.rank[positions], self.index[positions]
        order = np.lexsort((index, rank, layout))
        positions, layout, rank, index = positions[order], layout[order], rank[order], index[order]
        starts = np.flatnonzero(np.concatenate(([True], layout[1:] != layout[:-1])))
        sizes = np.diff(np.append(starts, positions.size))
        base = positions[np.repeat(starts, sizes)]
        sum_sq, max_abs, fingerprint, nonfinite = self._grad_columns
        delta = np.abs(np.sqrt(sum_sq[positions]) - np.sqrt(sum_sq[base]))
        delta = np.maximum(delta, np.abs(max_abs[positions] - max_abs[base]))
        if fingerprint.shape[1]:
            delta = np.maximum(delta, np.abs(fingerprint[positions] - fingerprint[base]).max(axis=1))
        delta[nonfinite[positions] != nonfinite[base]] = math.inf
        bases = positions[starts]
        described = self._set_bases
        deltas, ranks, indices, layouts = delta.tolist(), rank.tolist(), index.tolist(), layout.tolist()
        base_sum_sq, base_max_abs = sum_sq[bases].tolist(), max_abs[bases].tolist()
        sets = []
        for k in np.lexsort((index[starts], rank[starts])).tolist():
            start, stop = int(starts[k]), int(starts[k] + sizes[k])
            param, regions, dtype, numel = described[layouts[start]]
            sets.append(
                ReplicaSet(
                    param=param,
                    regions=regions,
                    dtype=dtype,
                    base_rank=ranks[start],
                    base_index=indices[start],
                    base_max_abs=base_max_abs[k],
                    base_sum_sq=base_sum_sq[k],
                    numel=numel,
                    copies=tuple(
                        ReplicaCopy(rank=ranks[i], index=indices[i], fingerprint_delta=deltas[i])
                        for i in range(start + 1, stop)
                    ),
                    by_values=False,
                )
            )
        return tuple(sets)

    def pieces(self, positions: np.ndarray | range) -> TablePieces:
        return TablePieces(self, positions)


def lowest_copies(layout: np.ndarray, order: np.ndarray) -> np.ndarray:
    """Of the positions in `order` (sorted by rank, then piece index), each layout's first: the
    disjoint cover's pieces, in that order."""
    _, first = np.unique(layout[order], return_index=True)  # a stable sort: the first occurrence
    return order[np.sort(first)]


def _sorting(keys: list[np.ndarray]) -> np.ndarray:
    """np.lexsort(keys[::-1]) (the first key primary): as one argsort of a combined key when the keys
    are non-negative except -1 padding and their product of ranges fits in int64 (flat ranges), else lexsort."""
    spans = [int(key.max()) + 2 for key in keys]
    if all(int(key.min()) >= -1 for key in keys) and math.prod(spans) < 2**62:
        combined = np.zeros(keys[0].size, dtype=np.int64)
        for key, span in zip(keys, spans, strict=True):
            combined *= span
            combined += key + 1
        return np.argsort(combined, kind="stable")
    return np.lexsort(keys[::-1])


def _layout_column(column: int, width: int) -> Callable[[int, ColumnarPieces], np.ndarray]:
    return lambda _, pieces: pieces.layout_column(column, width)


def _take(array: np.ndarray, chosen: np.ndarray | None) -> np.ndarray:
    return array if chosen is None else array[chosen]


def _count(chosen: np.ndarray | None, param: np.ndarray) -> int:
    return len(param) if chosen is None else int(chosen.size)


def piece_table(step: StepDump, names: Iterable[str]) -> PieceTable | None:
    """The table of the step's pieces of these parameters, or None unless every present rank's
    pieces are statistics only (`ColumnarPieces.stats_only`) of one kind set, fingerprint length
    and norm type."""
    sources, scales = [], []
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        pieces = dump.columns
        if not len(pieces):
            continue
        if not pieces.stats_only:
            return None
        sources.append((rank, dump.path, pieces))
        scales.append(dumped_gradient_scale(dump))
    if not sources:
        return None
    first = sources[0][2]
    kinds, length = sorted(first.kinds), first.fingerprint_length
    for _, _, pieces in sources:
        if (
            sorted(pieces.kinds) != kinds
            or pieces.fingerprint_length != length
            or pieces.norm_type != first.norm_type
        ):
            return None
    return PieceTable(sources, list(step.params), names, scales)


class TablePieces(Sequence[PieceMeasurement]):
    """Measurements of some positions of a PieceTable (a range, or an array of positions), built
    when indexed or iterated (not kept); equal to any sequence of equal measurements, and pickled
    as a tuple of them."""

    __slots__ = ("_positions", "table")

    def __init__(self, table: PieceTable, positions: np.ndarray | range) -> None:
        self.table, self._positions = table, positions

    @property
    def positions(self) -> np.ndarray:
        found = self._positions
        if isinstance(found, range):
            return np.arange(found.start, found.stop, dtype=np.int64)
        return found

    @property
    def span(self) -> range | None:
        """The positions when they are one range (a parameter's pieces), else None."""
        return self._positions if isinstance(self._positions, range) else None

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> PieceMeasurement: ...

    @overload
    def __getitem__(self, index: slice) -> TablePieces: ...

    def __getitem__(self, index: int | slice) -> PieceMeasurement | TablePieces:
        if isinstance(index, slice):
            return TablePieces(self.table, self._positions[index])
        return self.table.measurements([int(self._positions[index])])[0]

    def __iter__(self) -> Iterator[PieceMeasurement]:
        for start in range(0, len(self), _BATCH):
            yield from self.table.measurements(self._positions[start : start + _BATCH])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TablePieces) and other.table is self.table:
            return bool(np.array_equal(self.positions, other.positions))
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TablePieces({len(self)} pieces)"

    def __reduce__(self) -> tuple[type[tuple[PieceMeasurement, ...]], tuple[tuple[PieceMeasurement, ...]]]:
        return tuple, (tuple(self),)
