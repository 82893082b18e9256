"""Every measured piece of a step as numpy columns, so that the diagnosis and the per-rank rows of a
many-rank step ask their questions of arrays instead of walking the pieces once per question."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..model import TensorKind
from ..norms import INF, NAN, UNKNOWN, term_column, term_of

__all__ = ["INF", "NAN", "UNKNOWN", "StepColumns"]
from .measurements import PieceMeasurement, StepMeasurements
from .table import PieceTable, TablePieces, lowest_copies


class StepColumns:
    """Every measured piece of a step as columns (in `m.pieces` order), from one pass over the pieces:
    what the diagnosis and the per-rank rows need for all pieces at once, as arrays, so that a
    many-rank step is not walked piece by piece once per question."""

    def __init__(self, m: StepMeasurements) -> None:
        self.norm_type = m.norm_type
        table, positions = _table_positions(m)
        self._table: tuple[PieceTable, slice | np.ndarray] | None = None
        if table is not None and positions is not None:
            self._from_table(table, positions)
        else:
            self._from_objects(tuple(m.pieces))
        self.flags = self.unknown.astype(np.int8) * UNKNOWN | _nonfinite_flags(self.counts)
        """Per piece, the UNKNOWN, NAN and INF bits of its gradient's term (see `flags_of_stats`)."""
        self.by_rank_order = np.lexsort((self.index, self.rank))
        self.distinct_layouts = (
            bool(np.unique(self.layout).size == self.layout.size)
            if table is None
            else bool(table.copies.max(initial=0) <= 1)
        )
        """No two pieces share a layout (no replicas)."""
        self._cover: np.ndarray | None = None
        """Positions sorted by (rank, piece index), as disjoint_cover visits them."""

    def _from_objects(self, pieces: tuple[PieceMeasurement, ...]) -> None:
        self.pieces: Sequence[PieceMeasurement] = pieces
        # One comprehension per column: several times cheaper per piece than one loop of appends.
        ids: dict[tuple[object, ...], int] = {}
        self.layout: np.ndarray = np.array(
            [ids.setdefault(p.layout_key, len(ids)) for p in pieces], dtype=np.int64
        )
        self.rank: np.ndarray = np.array([p.rank for p in pieces], dtype=np.int64)
        self.index: np.ndarray = np.array([p.index for p in pieces], dtype=np.int64)
        self.dtypes = frozenset(p.dtype for p in pieces)
        names: dict[str, int] = {}
        self.param: np.ndarray = np.array(
            [names.setdefault(p.param, len(names)) for p in pieces], dtype=np.int64
        )
        self.param_names = list(names)
        self.has_grad, sums, self.counts, self.term, self.unknown = self._object_kind("grad")
        self.sum_pow, self.sum_sq = sums[:, 0], sums[:, 1]
        self.has_clipped = np.array(["grad_clipped" in p.stats for p in pieces], dtype=bool)
        self.has_update = np.array([p.update_sum_sq is not None for p in pieces], dtype=bool)
        self.has_dots = np.array(
            [p.dot_pre_post is not None and p.dot_pre_pre is not None for p in pieces], dtype=bool
        )
        """Per piece, whether it holds the dense dumps' products of its gradient before and after
        clipping (sum(pre * post), sum(pre * pre): set together)."""
        self.dot_pre_post = np.array([p.dot_pre_post or 0.0 for p in pieces], dtype=np.float64)
        self.dot_pre_pre = np.array([p.dot_pre_pre or 0.0 for p in pieces], dtype=np.float64)

    def _object_kind(self, kind: TensorKind) -> tuple[np.ndarray, ...]:
        """Per piece object: whether it holds `kind`; its [n, 3] (sum_pow, sum_sq, max_abs) and (nan,
        +inf, -inf) counts, 0 where it holds none; its term (0 where it holds none, nan where unknown:
        stats taken for another norm type); whether that term is unknown."""
        stats = [p.stats.get(kind) for p in self.pieces]
        rows = [
            (0,) * 6 if s is None else (s.sum_pow, s.sum_sq, s.max_abs, s.num_nan, s.num_posinf, s.num_neginf)
            for s in stats
        ]
        values = np.array(rows, dtype=np.float64).reshape(len(rows), 6)
        terms = [0.0 if s is None else term_of(s, self.norm_type) for s in stats]
        term = np.array([math.nan if t is None else t for t in terms], dtype=np.float64)
        has = np.array([s is not None for s in stats], dtype=bool)
        return has, values[:, :3], values[:, 3:].astype(np.int64), term, np.array([t is None for t in terms])

    def _from_table(self, table: PieceTable, positions: np.ndarray | range) -> None:
        """The same columns from a PieceTable's arrays (stats-only pieces: no products, no updates)."""
        norm_type, n = self.norm_type, len(positions)
        self.pieces = table.pieces(positions)
        if isinstance(positions, range):
            chosen: slice | np.ndarray = slice(positions.start, positions.stop)
        else:
            chosen = positions
        self._table = (table, chosen)
        self.layout = table.layout[chosen]
        self.param, self.param_names = table.param[chosen], table.names
        self.rank = table.rank[chosen]
        self.index = table.index[chosen]
        self.dtypes = frozenset(table.dtype_names[c] for c in np.unique(table.dtype[chosen]).tolist())
        self.has_clipped = np.full(n, "grad_clipped" in table.kinds)
        self.has_update = np.zeros(n, dtype=bool)
        self.has_dots = np.zeros(n, dtype=bool)
        self.dot_pre_post = self.dot_pre_pre = np.zeros(n)
        self.unknown = np.zeros(n, dtype=bool)
        if "grad" not in table.kinds:
            self.has_grad = np.zeros(n, dtype=bool)
            self.term, self.sum_pow, self.sum_sq = np.zeros(n), np.zeros(n), np.zeros(n)
            self.counts = np.zeros((n, 3), dtype=np.int64)
            return
        self.has_grad = np.ones(n, dtype=bool)
        self.sum_pow = table.kind_column("grad", 0)[chosen]
        # Read-only stand-ins where the columns hold nothing new (the common case), not a copy per piece:
        # the L2 norm's two sums are one column, and a step without nonfinite values counts zeros.
        same = (table.norm_type == 2.0 or set(table.scales) == {1.0}) and table.all_sources(
            lambda pieces: np.array_equal(pieces.stats["grad"][:, 0], pieces.stats["grad"][:, 1])
        )  # equal sums stay equal divided by the loss scale when they are both of squares
        self.sum_sq = self.sum_pow if same else table.kind_column("grad", 1)[chosen]
        if table.all_sources(lambda pieces: not pieces.counts["grad"].any()):
            self.counts = np.broadcast_to(np.zeros((1, 3), dtype=np.int64), (n, 3))
        else:
            self.counts = table.kind_counts("grad")[chosen]
        column = term_column(table.norm_type, norm_type)
        if column is None:
            self.unknown = np.ones(n, dtype=bool)
            self.term = np.full(n, math.nan)
        else:  # max |x| is gathered only for the inf-norm
            self.term = (
                table.kind_column("grad", 2)[chosen] if column == 2 else (self.sum_pow, self.sum_sq)[column]
            )

    def kind_sums(self, kind: TensorKind) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(whether each piece holds `kind`, its sum of squares, its max |x|, its count of nonfinite
        values; 0 where it does not hold the kind), in `m.pieces` order."""
        n = self.rank.size
        if self._table is not None:
            table, chosen = self._table
            if kind not in table.kinds:
                return np.zeros(n, dtype=bool), np.zeros(n), np.zeros(n), np.zeros(n, dtype=np.int64)
            return (
                np.ones(n, dtype=bool),
                table.kind_column(kind, 1)[chosen],
                table.kind_column(kind, 2)[chosen],
                table.kind_counts(kind)[chosen].sum(axis=1),
            )
        has, sums, counts, _, _ = self._object_kind(kind)
        return has, sums[:, 1], sums[:, 2], counts.sum(axis=1)

    def kind_terms(self, kind: TensorKind) -> tuple[np.ndarray, np.ndarray]:
        """(each piece's term of the p-norm of its `kind` statistics, 0 where it holds none; int8
        UNKNOWN, NAN and INF bits of that term, UNKNOWN where it holds none), in `m.pieces` order."""
        if self._table is None:
            has, _, counts, term, unknown = self._object_kind(kind)
            flags = np.where(~has | unknown, UNKNOWN, _nonfinite_flags(counts)).astype(np.int8)
            return np.where(unknown, 0.0, term), flags
        table, chosen = self._table
        column = term_column(table.norm_type, self.norm_type)
        if kind not in table.kinds or column is None:
            return np.zeros(self.rank.size), np.full(self.rank.size, UNKNOWN, dtype=np.int8)
        return table.kind_column(kind, column)[chosen], _nonfinite_flags(table.kind_counts(kind)[chosen])

    def cover_positions(self) -> np.ndarray:
        """Positions of disjoint_cover(m.pieces): each layout's lowest (rank, index) piece, in that order."""
        if self._cover is None:
            order = self.by_rank_order  # no replicas: every piece is its layout's only copy
            self._cover = order if self.distinct_layouts else lowest_copies(self.layout, order)
        return self._cover

    def cover(self) -> Sequence[PieceMeasurement]:
        return self._subset(self.cover_positions())

    def _subset(self, chosen: np.ndarray) -> Sequence[PieceMeasurement]:
        """The pieces at these positions: a TablePieces of the same table, or a tuple."""
        if self._table is not None:
            table, rows = self._table
            return table.pieces(chosen + (rows.start or 0) if isinstance(rows, slice) else rows[chosen])
        return tuple(self.pieces[i] for i in chosen.tolist())

    def cover_with_updates(self) -> list[PieceMeasurement]:
        """The cover's pieces that hold an update (parameters dumped before and after the step)."""
        chosen = self.cover_positions()
        return list(self._subset(chosen[self.has_update[chosen]]))

    def overflowing_grad(self) -> list[PieceMeasurement]:
        """The pieces whose gradient sum of squares or of |x|^p is inf, in `m.pieces` order."""
        chosen = np.flatnonzero(self.has_grad & (np.isinf(self.sum_sq) | np.isinf(self.sum_pow)))
        return list(self._subset(chosen))

    def with_nonfinite_grad(self) -> list[PieceMeasurement]:
        """The pieces whose gradient holds a nan or an infinity, in `m.pieces` order."""
        return list(self._subset(np.flatnonzero(self.counts.any(axis=1))))

    def grad_counts_by_rank(self) -> dict[int, tuple[int, int, int]]:
        """Rank -> (nan, +inf, -inf) counts of its gradient pieces (ranks with any piece)."""
        ranks, inverse = np.unique(self.rank, return_inverse=True)
        totals = np.zeros((ranks.size, 3), dtype=np.int64)
        for column in range(3):
            if self.counts[:, column].any():
                totals[:, column] = np.bincount(
                    inverse, weights=self.counts[:, column], minlength=ranks.size
                ).astype(np.int64)
        return {r: (a, b, c) for r, (a, b, c) in zip(ranks.tolist(), totals.tolist(), strict=True)}


def _nonfinite_flags(counts: np.ndarray) -> np.ndarray:
    """Per row of [n, 3] (nan, +inf, -inf) counts, its int8 NAN and INF bits."""
    infinite = (counts[:, 1] + counts[:, 2]) > 0
    flags: np.ndarray = (counts[:, 0] > 0).astype(np.int8) * NAN | infinite.astype(np.int8) * INF
    return flags


def _table_positions(m: StepMeasurements) -> tuple[PieceTable | None, np.ndarray | range | None]:
    """The table every parameter's pieces are in and their positions, in `m.pieces` order; None
    when some pieces are objects (or in another table)."""
    table, parts = None, []
    for pm in m.params.values():
        pieces = pm.pieces
        if isinstance(pieces, TablePieces) and (table is None or pieces.table is table):
            table = pieces.table
            parts.append(pieces)
        elif len(pieces):
            return None, None
    if table is None:
        return None, None
    spans = [p.span for p in parts]
    ends = [0] + [s.stop for s in spans if s is not None]
    if all(s is not None and s.start == end for s, end in zip(spans, ends, strict=False)):
        return table, range(ends[-1])  # every parameter's pieces, one after the other
    return table, np.concatenate([p.positions for p in parts])
