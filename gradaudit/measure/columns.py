"""Every measured piece of a step as numpy columns, so that the diagnosis and the per-rank rows of a
many-rank step ask their questions of arrays instead of walking the pieces once per question."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import numpy as np

from ..model import TensorKind
from ..norms import INF, NAN, UNKNOWN

__all__ = ["INF", "NAN", "UNKNOWN", "StepColumns"]
from .measurements import PieceMeasurement, StepMeasurements
from .table import PieceTable, TablePieces, lowest_copies


class StepColumns:
    """Every measured piece of a step as columns (in `m.pieces` order), read from the step's one
    table: what the diagnosis and the per-rank rows need for all pieces at once, as arrays, so that
    a many-rank step is not walked piece by piece once per question."""

    def __init__(self, m: StepMeasurements) -> None:
        self.norm_type = norm_type = m.norm_type
        table, positions = _table_positions(m)
        chosen: slice | np.ndarray = (
            slice(positions.start, positions.stop) if isinstance(positions, range) else positions
        )
        self._table, n = (table, chosen), len(positions)
        self.pieces: Sequence[PieceMeasurement] = table.pieces(positions)
        self.layout = table.layout[chosen]
        self.param, self.param_names = table.param[chosen], table.names
        self.rank = table.rank[chosen]
        self.index = table.index[chosen]
        self.dtypes = frozenset(table.dtype_names[c] for c in np.unique(table.dtype[chosen]).tolist())
        self.has_clipped = table.kind_has("grad_clipped")[chosen]
        products, has = table.products()
        self.has_update = has[chosen, 2]
        self.has_dots = has[chosen, 0] & has[chosen, 1]
        """Per piece, whether it holds the dense dumps' products of its gradient before and after
        clipping (sum(pre * post), sum(pre * pre): set together)."""
        self.dot_pre_post, self.dot_pre_pre = products[chosen, 0], products[chosen, 1]
        self.has_grad = table.kind_has("grad")[chosen]
        self.sum_pow = table.kind_column("grad", 0)[chosen]
        # Read-only stand-ins where the columns hold nothing new (the common case), not a copy per piece:
        # the L2 norm's two sums are one column, and a step without nonfinite values counts zeros.
        same = (
            not table.with_values
            and ((table.stats_only and table.sources[0][2].norm_type == 2.0) or set(table.scales) == {1.0})
            and table.all_sources(
                lambda pieces: (
                    "grad" not in pieces.stats
                    or np.array_equal(pieces.stats["grad"][:, 0], pieces.stats["grad"][:, 1])
                )
            )
        )  # equal sums stay equal divided by the loss scale when they are both of squares
        self.sum_sq = self.sum_pow if same else table.kind_column("grad", 1)[chosen]
        if not table.with_values and table.all_sources(
            lambda p: "grad" not in p.counts or not p.counts["grad"].any()
        ):
            self.counts = np.broadcast_to(np.zeros((1, 3), dtype=np.int64), (n, 3))
        else:
            self.counts = table.kind_counts("grad")[chosen]
        term, unknown = table.kind_term("grad", norm_type)
        self.term = np.where(unknown, math.nan, term)[chosen] if unknown.any() else term[chosen]
        self.unknown = unknown[chosen]
        self.flags = self.unknown.astype(np.int8) * UNKNOWN | _nonfinite_flags(self.counts)
        """Per piece, the UNKNOWN, NAN and INF bits of its gradient's term (see `flags_of_stats`)."""
        self.by_rank_order = np.lexsort((self.index, self.rank))
        self.distinct_layouts = bool(table.copies.max(initial=0) <= 1) or bool(
            np.unique(self.layout).size == self.layout.size
        )
        """No two pieces share a layout (no replicas)."""
        self._cover: np.ndarray | None = None
        """The disjoint cover's positions, once computed (`cover_positions`)."""

    def kind_sums(self, kind: TensorKind) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(whether each piece holds `kind`, its sum of squares, its max |x|, its count of nonfinite
        values; 0 where it does not hold the kind), in `m.pieces` order."""
        table, chosen = self._table
        return (
            table.kind_has(kind)[chosen],
            table.kind_column(kind, 1)[chosen],
            table.kind_column(kind, 2)[chosen],
            table.kind_nonfinite(kind)[chosen],
        )

    def kind_terms(self, kind: TensorKind) -> tuple[np.ndarray, np.ndarray]:
        """(each piece's term of the p-norm of its `kind` statistics, 0 where it holds none; int8
        UNKNOWN, NAN and INF bits of that term, UNKNOWN where it holds none), in `m.pieces` order."""
        table, chosen = self._table
        term, unknown = table.kind_term(kind, self.norm_type)
        has, counts = table.kind_has(kind)[chosen], table.kind_counts(kind)[chosen]
        flags = np.where(~has | unknown[chosen], UNKNOWN, _nonfinite_flags(counts)).astype(np.int8)
        return term[chosen], flags

    def cover_positions(self) -> np.ndarray:
        """The disjoint cover: each layout's lowest (rank, index) piece, in that order."""
        if self._cover is None:
            order = self.by_rank_order  # no replicas: every piece is its layout's only copy
            self._cover = order if self.distinct_layouts else lowest_copies(self.layout, order)
        return self._cover

    def cover(self) -> Sequence[PieceMeasurement]:
        return self._subset(self.cover_positions())

    def _subset(self, chosen: np.ndarray) -> Sequence[PieceMeasurement]:
        """The pieces at these positions (of the columns), as rows of the table."""
        table, rows = self._table
        return table.pieces(chosen + (rows.start or 0) if isinstance(rows, slice) else rows[chosen])

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
        held = np.bincount(self.rank)
        ranks = np.flatnonzero(held)
        totals = np.zeros((ranks.size, 3), dtype=np.int64)
        for column in range(3):
            if self.counts[:, column].any():
                by_rank = np.bincount(self.rank, weights=self.counts[:, column], minlength=held.size)
                totals[:, column] = by_rank[ranks].astype(np.int64)
        return {r: (a, b, c) for r, (a, b, c) in zip(ranks.tolist(), totals.tolist(), strict=True)}


def _nonfinite_flags(counts: np.ndarray) -> np.ndarray:
    """Per row of [n, 3] (nan, +inf, -inf) counts, its int8 NAN and INF bits."""
    infinite = (counts[:, 1] + counts[:, 2]) > 0
    flags: np.ndarray = (counts[:, 0] > 0).astype(np.int8) * NAN | infinite.astype(np.int8) * INF
    return flags


def _table_positions(m: StepMeasurements) -> tuple[PieceTable, np.ndarray | range]:
    """The table every parameter's pieces are in and their positions, in `m.pieces` order."""
    parts = [cast("TablePieces", pm.pieces) for pm in m.params.values()]
    tables = {id(p.table): p.table for p in parts}
    if len(tables) > 1:
        raise ValueError(
            "the measurements hold pieces of several tables; merge them with StepMeasurements.merge"
        )
    table = next(iter(tables.values()), None) or PieceTable([], [], [])
    spans = [p.span for p in parts]
    ends = [0] + [s.stop for s in spans if s is not None]
    if all(s is not None and s.start == end for s, end in zip(spans, ends, strict=False)):
        return table, range(ends[-1])  # every parameter's pieces, one after the other
    return table, np.concatenate([p.positions for p in parts])
