"""Stats-only pieces of format-1.1 ranks measured as columns: one table for the whole step instead
of a PieceMeasurement per piece (millions of them in a many-rank stats dump).

A piece of such a rank has nothing to read and no loss scale to divide by: its measurement is its
stored statistics. The table keeps each rank's ColumnarPieces and, step-wide, the parameter, rank,
index and layout of every piece; a PieceMeasurement is built only for the pieces a caller asks for
(a finding that names a few, the copies of a replicated layout).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

from ..dumpfile.columnar import ColumnarPieces, ParamIds
from ..model import Piece, StepDump
from .measure import PieceMeasurement, dumped_gradient_scale

_BATCH = 1024


class PieceTable:
    """Every piece of the chosen parameters on the step's format-1.1 ranks, "rank-major" (by rank,
    then piece index, as the ranks' columns are concatenated): position `p` is piece
    `index[p]` of rank `rank[p]`. `order` lists the positions by parameter (then rank and index)."""

    def __init__(
        self,
        sources: Sequence[tuple[int, str, ColumnarPieces]],
        names: Sequence[str],
        wanted: Iterable[str],
    ) -> None:
        self.sources = tuple(sources)
        self.kinds = tuple(sorted(sources[0][2].kinds))
        self.norm_type = sources[0][2].norm_type
        ids = ParamIds(names)
        per_source = [ids.of(pieces) for _, _, pieces in sources]
        self.names = list(ids.ids)
        keep = np.zeros(len(self.names), dtype=bool)
        keep[[ids.ids[name] for name in wanted]] = True
        self._chosen = [np.flatnonzero(keep[param]) for param in per_source]
        """Per source, the local indices of the pieces kept."""
        sizes = np.array([c.size for c in self._chosen], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(sizes)))
        self.size = int(self.offsets[-1])
        self.param = np.concatenate([p[c] for p, c in zip(per_source, self._chosen, strict=True)]).astype(
            np.int32
        )
        self.rank = np.repeat(np.array([rank for rank, _, _ in sources], dtype=np.int32), sizes)
        self.index = np.concatenate(self._chosen).astype(np.int32)
        dtypes: dict[str, int] = {}
        codes: list[np.ndarray] = []
        seen: tuple[object, np.ndarray] = ((), np.zeros(0, dtype=np.int16))
        for (_, _, pieces), c in zip(sources, self._chosen, strict=True):
            if not (seen[0] is pieces.params or seen[0] == pieces.params):
                table = [dtypes.setdefault(p.dtype, len(dtypes)) for p in pieces.params]
                seen = (pieces.params, np.array(table, dtype=np.int16))
            codes.append(seen[1][pieces.rows[c, 0]])
        self.dtype = np.concatenate(codes)
        self.dtype_names = list(dtypes)
        self.order = np.argsort(self.param, kind="stable")
        bounds = np.searchsorted(self.param[self.order], np.arange(len(self.names) + 1))
        self.bounds = {name: (int(bounds[i]), int(bounds[i + 1])) for i, name in enumerate(self.names)}
        self.layout = self._layouts()
        self.copies = np.bincount(self.layout) if self.size else np.zeros(0, dtype=np.int64)
        """Pieces holding each layout: more than one are replicas."""

    def _layouts(self) -> np.ndarray:
        """A number per position, equal exactly when the pieces' layout keys are."""
        width = max(pieces.layout_width for _, _, pieces in self.sources)
        rows = np.concatenate(
            [pieces.layout(width)[c] for (_, _, pieces), c in zip(self.sources, self._chosen, strict=True)]
        )
        rows[:, 0] = self.param
        if not len(rows):
            return np.zeros(0, dtype=np.int64)
        order = np.lexsort(rows.T[::-1])
        ordered = rows[order]
        starts = np.ones(len(rows), dtype=bool)
        starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
        layout = np.empty(len(rows), dtype=np.int64)
        layout[order] = np.cumsum(starts) - 1
        return layout

    def kind_column(self, kind: str, column: int) -> np.ndarray:
        """Column `column` of every position's `kind` statistics (0 sum_pow, 1 sum_sq, 2 max_abs)."""
        return np.concatenate(
            [
                pieces.stats[kind][c, column]
                for (_, _, pieces), c in zip(self.sources, self._chosen, strict=True)
            ]
        )

    def kind_counts(self, kind: str) -> np.ndarray:
        """[n, 3] nonfinite counts (nan, +inf, -inf) of every position's `kind`."""
        return np.concatenate(
            [pieces.counts[kind][c] for (_, _, pieces), c in zip(self.sources, self._chosen, strict=True)]
        )

    def param_positions(self, name: str) -> np.ndarray:
        start, stop = self.bounds.get(name, (0, 0))
        return self.order[start:stop]

    def entries(self, positions: Sequence[int] | np.ndarray) -> list[tuple[int, str, Piece]]:
        """(rank, file path, piece) at each position, the piece built from its rank's columns."""
        positions = np.asarray(positions, dtype=np.int64)
        source = np.searchsorted(self.offsets, positions, side="right") - 1
        found: list[tuple[int, str, Piece] | None] = [None] * positions.size
        for k in np.unique(source).tolist():
            at = np.flatnonzero(source == k)
            rank, path, pieces = self.sources[k]
            local = self._chosen[k][positions[at] - self.offsets[k]]
            for i, piece in zip(at.tolist(), pieces.build(local.tolist()), strict=True):
                found[i] = (rank, path, piece)
        return [entry for entry in found if entry is not None]

    def measurements(self, positions: Sequence[int] | np.ndarray) -> list[PieceMeasurement]:
        """The PieceMeasurement of each position, as _measure_piece gives for a stats-only piece."""
        return [
            PieceMeasurement(
                rank=rank,
                index=piece.index,
                param=piece.param,
                regions=piece.regions,
                dtype=piece.dtype,
                numel=piece.numel,
                replica_group=piece.replica_group,
                stats=dict(sorted(piece.stats.items())) if len(piece.stats) > 1 else piece.stats,
            )
            for rank, _, piece in self.entries(positions)
        ]

    def pieces(self, positions: np.ndarray) -> TablePieces:
        return TablePieces(self, positions)


def piece_table(step: StepDump, names: Iterable[str]) -> PieceTable | None:
    """The table of the step's pieces of these parameters, or None unless every present rank's
    pieces are format-1.1 columns of one kind set, fingerprint length and norm type, without a
    loss scale to divide by."""
    sources = []
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        pieces = dump.pieces
        if not len(pieces):
            continue
        if not isinstance(pieces, ColumnarPieces) or dumped_gradient_scale(dump) != 1.0:
            return None
        sources.append((rank, dump.path, pieces))
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
    return PieceTable(sources, list(step.params), names)


class TablePieces(Sequence[PieceMeasurement]):
    """Measurements of some positions of a PieceTable, built when indexed or iterated (not kept);
    equal to any sequence of equal measurements, and pickled as a tuple of them."""

    __slots__ = ("positions", "table")

    def __init__(self, table: PieceTable, positions: np.ndarray) -> None:
        self.table, self.positions = table, positions

    def __len__(self) -> int:
        return int(self.positions.size)

    @overload
    def __getitem__(self, index: int) -> PieceMeasurement: ...

    @overload
    def __getitem__(self, index: slice) -> TablePieces: ...

    def __getitem__(self, index: int | slice) -> PieceMeasurement | TablePieces:
        if isinstance(index, slice):
            return TablePieces(self.table, self.positions[index])
        return self.table.measurements([int(self.positions[index])])[0]

    def __iter__(self) -> Iterator[PieceMeasurement]:
        for start in range(0, len(self), _BATCH):
            yield from self.table.measurements(self.positions[start : start + _BATCH])

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
