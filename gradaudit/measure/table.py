"""A step's pieces measured as columns: one table for the whole step, whatever its ranks hold.

The table keeps each rank's ColumnarPieces and, step-wide, the parameter, rank, index and layout of
every piece. A piece's measurement is its stored statistics (the gradient's divided by its rank's
loss scale, `gradient_scale_of`, when the dump holds them before unscale_), overwritten by what
the tensor pass read from its values (`record`): arrays indexed by position. `step_table` freezes
it into the step table the analysis reads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..dumpfile.columnar import ColumnarPieces, ParamIds
from ..dumpfile.dump import StepDump
from ..model import Piece, Region, TensorKind, TensorStats
from ..norms import INF, NAN, UNKNOWN, term_column, term_of
from ..steptable import KindColumns, ReplicaCopy, ReplicaSet, StepTable
from .measurements import (
    SCALED_KINDS,
    call_columns,
    call_row,
    call_scale,
    gradient_scale_of,
    unscaled_stats,
    unscaled_sums,
)

_READ, _FINGERPRINTED, _REMOVED = 1, 2, -1
"""A position's state per kind in the tensor pass: read from its values (with the fingerprint), or
its statistics dropped (a partial sum's kind that the group's sum does not give)."""


_Key = tuple[str, TensorKind, int]
"""A gathered column: (what, kind, column)."""
_ReadAt = Callable[[np.ndarray], np.ndarray]
"""What the tensor pass read at these positions (a column of theirs)."""


class PieceTable:
    """Every piece of the chosen parameters on the step's ranks, by parameter (in the order of
    `names`), then rank, then piece index: position `p` is piece `local[p]` (its index, its position
    in its file) of rank `rank[p]`, and a parameter's pieces are the positions `bounds[name]`.
    `dropped`: rank -> positions in its file left out (the members of a partial sum but its base)."""

    def __init__(
        self,
        sources: Sequence[tuple[int, str, ColumnarPieces]],
        names: Sequence[str],
        wanted: Iterable[str],
        scales: Sequence[float],
        *,
        norm_type: float = 2.0,
        dropped: Mapping[int, Iterable[int]] | None = None,
    ) -> None:
        self.sources = tuple(sources)
        self.wanted = frozenset(wanted)
        self.dropped = {rank: tuple(at) for rank, at in (dropped or {}).items()}
        self.read_norm_type = float(norm_type)
        """`p` of the statistics the tensor pass reads (the measurement's norm type)."""
        self.scales = tuple(scales)
        """Per source, `gradient_scale_of` of its rank: its gradients' columns are divided by it."""
        self._source_of = {rank: k for k, (rank, _, _) in enumerate(self.sources)}
        ids = ParamIds(names)
        per_source = [ids.of(pieces).astype(np.int32) for _, _, pieces in self.sources]
        self.names = list(ids.ids)
        keep = np.zeros(len(self.names), dtype=bool)
        keep[[ids.ids[name] for name in self.wanted if name in ids.ids]] = True
        self._chosen: list[np.ndarray | None] = []
        """Per source, the local indices of the pieces kept (None: all)."""
        for (rank, _, _), param in zip(self.sources, per_source, strict=True):
            kept = keep[param]  # a new array: fancy indexing copies
            if self.dropped.get(rank):
                kept[list(self.dropped[rank])] = False
            self._chosen.append(None if kept.all() else np.flatnonzero(kept))
        files = [
            np.arange(len(p), dtype=np.int32) if c is None else c.astype(np.int32)
            for p, c in zip(per_source, self._chosen, strict=True)
        ]
        sizes = [len(at) for at in files]
        self.size = sum(sizes)
        empty = np.zeros(0, dtype=np.int32)
        param = np.concatenate(
            [_take(p, c) for p, c in zip(per_source, self._chosen, strict=True)] or [empty]
        )
        ranks = np.repeat(np.array([r for r, _, _ in self.sources], dtype=np.int32), sizes)
        local = np.concatenate(files or [empty])
        self._order = np.argsort(param, kind="stable")
        """Rank-major position (the ranks' columns one after the other) of each position."""
        self.param, self.rank = param[self._order], ranks[self._order]
        self.local = local[self._order]
        del param, per_source, ranks, local
        dtypes: dict[str, int] = {}
        codes: list[np.ndarray] = []
        seen: tuple[object, np.ndarray] = ((), np.zeros(0, dtype=np.int16))
        for _, _, pieces in self.sources:
            if not (seen[0] is pieces.params or seen[0] == pieces.params):
                table = [dtypes.setdefault(p.dtype, len(dtypes)) for p in pieces.params]
                seen = (pieces.params, np.array(table, dtype=np.int16))
            code = seen[1][pieces.rows[:, 0]]  # a new array: fancy indexing copies
            for at, dtype in pieces.extras.dtypes.items():
                code[at] = dtypes.setdefault(dtype, len(dtypes))
            codes.append(code)
        self.dtype = self._gather(lambda k, _: codes[k])
        self.dtype_names = list(dtypes)
        bounds = np.searchsorted(self.param, np.arange(len(self.names) + 1))
        self.bounds = {name: (int(bounds[i]), int(bounds[i + 1])) for i, name in enumerate(self.names)}
        self.layout, self.numel = self._layouts()
        """Per position, its layout (equal ids: replicas) and its piece's elements."""
        self.copies = np.bincount(self.layout) if self.size else np.zeros(0, dtype=np.int64)
        """Pieces holding each layout: more than one are replicas."""
        reads = sorted({kind for _, _, pieces in self.sources for kind in pieces.tensor_kinds})
        if reads:  # a partial sum's base may lose a stored kind of these too
            reads = sorted({*reads, *SCALED_KINDS})
        n = self.size
        self.with_values = {kind: self._gather(_tensor_flags(kind)) for kind in reads}
        """Per kind some piece holds values of, whether each position does."""
        self._state = {kind: np.zeros(n, dtype=np.int8) for kind in reads}
        """Per kind read from some piece's values, each position's state in the tensor pass."""
        self._read = {kind: np.zeros((n, 5)) for kind in reads}
        """Per kind, (sum_pow, sum_sq, max_abs, fingerprint) read, as the values were dumped."""
        self._read_counts = {kind: np.zeros((n, 3), dtype=np.int64) for kind in reads}
        self.products = np.zeros((n, 3)) if reads else np.broadcast_to(0.0, (n, 3))
        """[n, 3] dot_pre_post, dot_pre_pre (unscaled), update_sum_sq read from each piece's values
        (read-only zeros when no piece holds values, not a copy per piece)."""
        self.has_products = np.zeros((n, 3), dtype=bool) if reads else np.broadcast_to(False, (n, 3))
        """[n, 3] whether each of `products` was read."""
        self.scale_at = np.repeat(self.scales, sizes)[self._order] if reads else np.zeros(0)
        """Per position, the value scale of its gradients (1 for a partial sum's base), when some
        piece holds values (else its rank's, `scales`)."""
        self._cache: dict[_Key, np.ndarray] = {}
        """Gathered gradient columns, by (what, kind, column): asked for by several questions."""

    @functools.cached_property
    def stats_only(self) -> bool:
        """Every rank's pieces are statistics only, of one kind set, fingerprint length and norm type."""
        if not self.sources:
            return False
        first = self.sources[0][2]
        kinds = sorted(first.kinds)
        return all(
            pieces.stats_only
            and sorted(pieces.kinds) == kinds
            and pieces.fingerprint_length == first.fingerprint_length
            and pieces.norm_type == first.norm_type
            for _, _, pieces in self.sources
        )

    def _gather(self, column: Callable[[int, ColumnarPieces], np.ndarray]) -> np.ndarray:
        """`column(k, pieces)` of every source `k`, rows kept only, in position order."""
        parts = [_take(column(k, pieces), self._chosen[k]) for k, (_, _, pieces) in enumerate(self.sources)]
        return np.concatenate(parts or [np.zeros(0)])[self._order]

    def _layouts(self) -> tuple[np.ndarray, np.ndarray]:
        """(a number per position, equal exactly when the pieces' layout keys are; the elements of
        each position's piece, from the same columns: a flat range's stop - start, a box's shape)."""
        if not self.size:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        width = max(pieces.layout_width for _, _, pieces in self.sources)
        keys = [self.param] + [self._gather(_layout_column(column, width)) for column in range(1, 2 + width)]
        ndim = keys[1]
        numel = keys[3] - keys[2]
        for k in np.unique(ndim[ndim > 0]).tolist():
            at = ndim == k
            numel[at] = np.prod(np.stack([keys[2 + k + j][at] for j in range(k)]), axis=0)
        order = _sorting(keys)
        starts = np.zeros(self.size, dtype=bool)
        starts[0] = True
        for key in keys:
            ordered = key[order]
            starts[1:] |= ordered[1:] != ordered[:-1]
        del keys
        layout = np.empty(self.size, dtype=np.int64)
        layout[order] = np.cumsum(starts) - 1
        # pieces of several regions: their key is the regions themselves
        if any(pieces.extras.regions for _, _, pieces in self.sources):
            at = np.flatnonzero(self._gather(lambda _, pieces: _flags(len(pieces), pieces.extras.regions)))
            ids: dict[tuple[object, ...], int] = {}
            for position, (_, _, piece) in zip(at.tolist(), self.entries(at), strict=True):
                layout[position] = self.size + ids.setdefault(piece.layout_key, len(ids))
                numel[position] = piece.numel
        return layout, numel.astype(np.int64, copy=False)

    def kind_has(self, kind: TensorKind) -> np.ndarray:
        """Whether each position holds `kind` (statistics stored or read)."""
        if all(kind in p.stats and not p.extras.absent.get(kind) for _, _, p in self.sources):
            has = np.ones(self.size, dtype=bool)
        elif all(kind not in p.stats for _, _, p in self.sources):
            has = np.zeros(self.size, dtype=bool)
        else:
            has = self._gather(lambda _, pieces: _holds(pieces, kind))
        state = self._state.get(kind)
        if state is not None and state.any():
            has = (has | (state > 0)) & (state != _REMOVED)
        return has

    def kind_column(self, kind: TensorKind, column: int) -> np.ndarray:
        """Column `column` of every position's `kind` statistics (0 sum_pow, 1 sum_sq, 2 max_abs),
        its gradients divided by their loss scale; 0 where it holds none."""
        return self._kept(
            ("column", kind, column),
            lambda: self._gather(lambda k, pieces: self._unscaled(k, kind, pieces, column)),
            lambda read: self._unscaled_read(kind, read)[column],
        )

    def _kept(self, key: _Key, stored: Callable[[], np.ndarray], read: _ReadAt) -> np.ndarray:
        """`stored()` overlaid with `read` (`_overlay`), kept when it is a column of the gradient
        (asked again by the columns, which hold it anyway): another kind's is gathered again when
        asked, not kept in memory."""
        found = self._cache.get(key)
        if found is None:
            found = self._overlay(key[1], stored(), read)
            if key[1] == "grad":
                self._cache[key] = found
        return found

    def _unscaled(self, source: int, kind: TensorKind, pieces: ColumnarPieces, column: int) -> np.ndarray:
        """Column `column` of one source's `kind` statistics, its gradients divided by its loss scale."""
        values = pieces.stats.get(kind)
        if values is None:
            return np.zeros(len(pieces))
        scale = self.scales[source]
        if scale == 1.0 or kind not in SCALED_KINDS:
            return values[:, column]
        if column >= 3:
            return values[:, column] / scale  # the fingerprint
        return unscaled_sums(values[:, 0], values[:, 1], values[:, 2], scale, pieces.norm_type)[column]

    def _unscaled_read(self, kind: TensorKind, at: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sum_pow, sum_sq, max_abs) read at these positions, gradients divided by their scale."""
        read, scales = self._read[kind][at], self.scale_at[at]
        out = read[:, 0].copy(), read[:, 1].copy(), read[:, 2].copy()
        if kind in SCALED_KINDS:
            for scale in np.unique(scales[scales != 1.0]).tolist():
                chosen = scales == scale
                pow_, sq, max_ = (column[chosen] for column in out)
                sums = unscaled_sums(pow_, sq, max_, scale, self.read_norm_type)
                for column, values in zip(out, sums, strict=True):
                    column[chosen] = values
        return out

    def _overlay(self, kind: TensorKind, stored: np.ndarray, read: _ReadAt) -> np.ndarray:
        state = self._state.get(kind)
        if state is None or not state.any():
            return stored
        at = np.flatnonzero(state > 0)
        out: np.ndarray = stored.copy()
        out[at] = read(at)
        out[state == _REMOVED] = 0
        return out

    def kind_counts(self, kind: TensorKind) -> np.ndarray:
        """[n, 3] nonfinite counts (nan, +inf, -inf) of every position's `kind`."""
        return self._kept(
            ("counts", kind, 0),
            lambda: self._gather(lambda _, pieces: _counts(pieces, kind)).reshape(self.size, 3),
            lambda at: self._read_counts[kind][at],
        )

    def kind_term(self, kind: TensorKind, norm_type: float) -> tuple[np.ndarray, np.ndarray]:
        """(each position's term of the `norm_type`-norm of its `kind` statistics, 0 where it holds
        none; whether that term is unknown: statistics taken for another norm type)."""

        def stored(k: int, pieces: ColumnarPieces) -> np.ndarray:
            column = term_column(pieces.norm_type, norm_type)
            if column is None:
                return np.full(len(pieces), math.nan)
            term = self._unscaled(k, kind, pieces, column)
            if pieces.extras.odd_stats:
                term = term.copy()
            for (at, odd_kind), stats in pieces.extras.odd_stats.items():
                if odd_kind == kind:
                    odd = term_of(stats, norm_type, self.scales[k] if kind in SCALED_KINDS else 1.0)
                    term[at] = math.nan if odd is None else odd
            return term

        columns = {term_column(pieces.norm_type, norm_type) for _, _, pieces in self.sources}
        if len(columns) == 1 and not self._state and not any(p.extras.odd_stats for _, _, p in self.sources):
            (only,) = columns
            if only is None:  # every term unknown where the kind is held
                return np.zeros(self.size), self.kind_has(kind)
            return self.kind_column(kind, only), np.zeros(self.size, dtype=bool)
        column = term_column(self.read_norm_type, norm_type)
        term = self._overlay(
            kind,
            self._gather(stored),
            lambda at: (
                np.full(at.size, math.nan) if column is None else self._unscaled_read(kind, at)[column]
            ),
        )
        has = self.kind_has(kind)
        unknown = has & np.isnan(term)
        return np.where(has & ~unknown, term, 0.0), unknown

    def record(
        self,
        position: int,
        stats: Mapping[TensorKind, TensorStats],
        products: tuple[float | None, float | None, float | None],
        *,
        removed: Iterable[TensorKind] = (),
        scale: float | None = None,
    ) -> None:
        """What the tensor pass read of the piece at `position`: statistics as the values were dumped,
        (unscaled) products; `removed`: kinds it no longer holds; `scale`: its value scale now."""
        self._cache.clear()
        for kind, s in stats.items():
            self._state[kind][position] = _FINGERPRINTED if s.fingerprint else _READ
            self._read[kind][position] = (s.sum_pow, s.sum_sq, s.max_abs, *(s.fingerprint or (0.0, 0.0)))
            self._read_counts[kind][position] = (s.num_nan, s.num_posinf, s.num_neginf)
        for kind in removed:
            self._state[kind][position] = _REMOVED
        self.products[position] = [0.0 if v is None else v for v in products]
        self.has_products[position] = [v is not None for v in products]
        if scale is not None:
            self.scale_at[position] = scale

    def scale_of(self, rank: int) -> float:
        """`gradient_scale_of` of this rank: its gradients' columns are divided by it."""
        return self.scales[self._source_of[rank]]

    def param_positions(self, name: str) -> range:
        return range(*self.bounds.get(name, (0, 0)))

    def cover(self, name: str) -> list[tuple[int, str, Piece]]:
        """(rank, path, piece) of each layout's lowest (rank, index) copy among the parameter's
        pieces: its disjoint cover, replicas through their lowest-rank copy."""
        positions = self.param_positions(name)
        at = np.arange(positions.start, positions.stop)
        return self.entries(lowest_copies(self.layout, at[np.lexsort((self.local[at], self.rank[at]))]))

    def find(self, rank: int, local: int) -> int:
        """The position of the piece at `local` in rank `rank`'s file."""
        return int(np.flatnonzero((self.rank == rank) & (self.local == local))[0])

    def entries(self, positions: Sequence[int] | np.ndarray) -> list[tuple[int, str, Piece]]:
        """(rank, file path, piece) at each position, the piece built from its rank's columns."""
        positions = np.asarray(positions, dtype=np.int64)
        ranks, locals_ = self.rank[positions], self.local[positions]
        found: list[tuple[int, str, Piece] | None] = [None] * positions.size
        by_rank = np.argsort(ranks, kind="stable")
        distinct, starts = np.unique(ranks[by_rank], return_index=True)
        bounds = [*starts.tolist(), positions.size]
        for k, rank in enumerate(distinct.tolist()):
            at = by_rank[bounds[k] : bounds[k + 1]]
            _, path, pieces = self.sources[self._source_of[rank]]
            for i, piece in zip(at.tolist(), pieces.build(locals_[at].tolist()), strict=True):
                found[i] = (rank, path, piece)
        return [entry for entry in found if entry is not None]

    def tensors(self, positions: np.ndarray) -> list[tuple[str, dict[TensorKind, str], int]]:
        """(file path, kind -> tensor key, elements) of the pieces at these positions."""
        found = []
        for position, rank, local in zip(
            positions.tolist(), self.rank[positions].tolist(), self.local[positions].tolist(), strict=True
        ):
            _, path, pieces = self.sources[self._source_of[rank]]
            keys = {kind: by[local] for kind, by in pieces.extras.tensors.items() if local in by}
            found.append((path, keys, int(self.numel[position])))
        return found

    def _grad_rows(self, positions: np.ndarray) -> tuple[np.ndarray, ...]:
        """sum_sq, max_abs, fingerprint [n, f] (zeros past its own length), fingerprint length (-1:
        no statistics) and nonfinite count of each position's gradient, what was read overriding
        what is stored, divided by its value scale: gathered once from the columns when the step
        is statistics only, else from each piece."""
        if self.stats_only and "grad" in self.sources[0][2].kinds:  # one kind set on every rank
            sum_sq, max_abs, fingerprint, nonfinite = self._grad_columns
            width = np.full(positions.size, fingerprint.shape[1])
            return sum_sq[positions], max_abs[positions], fingerprint[positions], width, nonfinite[positions]
        found: list[TensorStats | None] = []
        state = self._state.get("grad")
        for position, (rank, _, piece) in zip(positions.tolist(), self.entries(positions), strict=True):
            flag = 0 if state is None else int(state[position])
            stats = None if flag == _REMOVED else piece.stats.get("grad")
            if flag > 0:  # read, as dumped
                sum_pow, sum_sq, max_abs, *fingerprint = self._read["grad"][position].tolist()
                nan, posinf, neginf = self._read_counts["grad"][position].tolist()
                stats = TensorStats(
                    numel=piece.numel,
                    norm_type=self.read_norm_type,
                    sum_pow=sum_pow,
                    sum_sq=sum_sq,
                    max_abs=max_abs,
                    num_nan=nan,
                    num_posinf=posinf,
                    num_neginf=neginf,
                    fingerprint=tuple(fingerprint) if flag == _FINGERPRINTED else (),
                )
            scale = float(self.scale_at[position]) if self.scale_at.size else self.scale_of(rank)
            found.append(None if stats is None else unscaled_stats(stats, scale))
        fingerprint = np.zeros((len(found), max((len(s.fingerprint) for s in found if s), default=0)))
        for row, stats in zip(fingerprint, found, strict=True):
            if stats is not None:
                row[: len(stats.fingerprint)] = stats.fingerprint
        return (
            np.array([0.0 if s is None else s.sum_sq for s in found]),
            np.array([0.0 if s is None else s.max_abs for s in found]),
            fingerprint,
            np.array([-1 if s is None else len(s.fingerprint) for s in found]),
            np.array([0 if s is None else s.num_nonfinite for s in found]),
        )

    @functools.cached_property
    def _grad_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """sum_sq, max_abs, fingerprint [n, f] and nonfinite count of every position's gradient
        (gathered once, when the step has replicas to compare)."""
        width = 3 + self.sources[0][2].fingerprint_length
        sum_sq, max_abs, *fingerprint = (self._gather(self._grad_column(c)) for c in range(1, width))
        counts = self._gather(lambda _, pieces: pieces.counts["grad"]).sum(axis=1)
        return (
            sum_sq,
            max_abs,
            np.stack(fingerprint, axis=1) if fingerprint else np.zeros((self.size, 0)),
            counts,
        )

    def _grad_column(self, column: int) -> Callable[[int, ColumnarPieces], np.ndarray]:
        return lambda k, pieces: self._unscaled(k, "grad", pieces, column)

    @functools.cached_property
    def _set_bases(self) -> dict[int, tuple[str, tuple[Region, ...], str, int]]:
        """Layout -> (param, regions, dtype, numel) of its lowest (rank, index) copy, for every
        replicated layout of the step: built at once, one call per rank, and only these kept."""
        replicated = np.flatnonzero(self.copies[self.layout] > 1)
        order = np.lexsort((self.local[replicated], self.rank[replicated]))
        bases = replicated[lowest_copies(self.layout[replicated], order)]
        return {
            layout_id: (piece.param, piece.regions, piece.dtype, piece.numel)
            for layout_id, (_, _, piece) in zip(self.layout[bases].tolist(), self.entries(bases), strict=True)
        }

    def replica_sets(self, positions: np.ndarray) -> tuple[ReplicaSet, ...]:
        """The replica sets of these replicated positions, each copy compared with its set's lowest
        (rank, index) copy by fingerprint, in the order of their base copies: objects only for each
        set's base piece and its copies' results."""
        layout, rank, index = self.layout[positions], self.rank[positions], self.local[positions]
        order = np.lexsort((index, rank, layout))
        positions, layout, rank, index = positions[order], layout[order], rank[order], index[order]
        starts = np.flatnonzero(np.concatenate(([True], layout[1:] != layout[:-1])))
        sizes = np.diff(np.append(starts, positions.size))
        base = np.repeat(starts, sizes)
        sum_sq, max_abs, fingerprint, width, nonfinite = self._grad_rows(positions)
        delta = np.abs(np.sqrt(sum_sq) - np.sqrt(sum_sq[base]))
        delta = np.maximum(delta, np.abs(max_abs - max_abs[base]))
        if fingerprint.shape[1]:
            delta = np.maximum(delta, np.abs(fingerprint - fingerprint[base]).max(axis=1))
        delta[nonfinite != nonfinite[base]] = math.inf
        compared = (width >= 0) & (width == width[base])  # else no statistics, or fingerprints of two lengths
        deltas = [d if c else None for d, c in zip(delta.tolist(), compared.tolist(), strict=True)]
        ranks, indices, layouts = rank.tolist(), index.tolist(), layout.tolist()
        base_sum_sq, base_max_abs = sum_sq[starts].tolist(), max_abs[starts].tolist()
        sets = []
        for k in np.lexsort((index[starts], rank[starts])).tolist():
            start, stop = int(starts[k]), int(starts[k] + sizes[k])
            param, regions, dtype, numel = self._set_bases[layouts[start]]
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


def _holds(pieces: ColumnarPieces, kind: TensorKind) -> np.ndarray:
    if kind not in pieces.stats:
        return np.zeros(len(pieces), dtype=bool)
    return ~_flags(len(pieces), pieces.extras.absent.get(kind))


def _counts(pieces: ColumnarPieces, kind: TensorKind) -> np.ndarray:
    counts = pieces.counts.get(kind)
    return np.zeros((len(pieces), 3), dtype=np.int64) if counts is None else counts


def _flags(n: int, positions: Iterable[int] | None) -> np.ndarray:
    flags = np.zeros(n, dtype=bool)
    if positions:
        flags[list(positions)] = True
    return flags


def _tensor_flags(kind: TensorKind) -> Callable[[int, ColumnarPieces], np.ndarray]:
    return lambda _, pieces: _flags(len(pieces), pieces.extras.tensors.get(kind))


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


def piece_table(
    step: StepDump,
    names: Iterable[str],
    *,
    norm_type: float = 2.0,
    dropped: Mapping[int, Iterable[int]] | None = None,
) -> PieceTable:
    """The table of the step's pieces of these parameters on every present rank (`norm_type`: of
    the statistics the tensor pass will read; `dropped`: see PieceTable)."""
    sources, scales = [], []
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        if len(dump.pieces):
            sources.append((rank, dump.path, dump.pieces))
            scales.append(gradient_scale_of(dump.clip))
    return PieceTable(sources, list(step.params), names, scales, norm_type=norm_type, dropped=dropped)


def step_table(step: StepDump, table: PieceTable, names: Iterable[str]) -> StepTable:
    """The step table of these parameters' pieces (in the order of `names`) as frozen columns,
    gathered once from the table the tensor pass wrote into."""
    norm_type = table.read_norm_type
    spans = [table.param_positions(name) for name in names]
    n = sum(len(s) for s in spans)
    ends = [0] + [s.stop for s in spans]
    if all(s.start == end for s, end in zip(spans, ends, strict=False)):
        chosen: slice | np.ndarray = slice(0, n)  # every parameter's pieces, one after the other
    else:
        chosen = np.concatenate([np.arange(s.start, s.stop) for s in spans] or [np.zeros(0, dtype=np.int64)])
    products, has_products = table.products, table.has_products
    # Read-only stand-ins where the columns hold nothing new (the common case), not a copy per piece:
    # the L2 norm's two sums are one column, and a step without nonfinite values counts zeros.
    same = (
        not table.with_values
        and ((table.stats_only and table.sources[0][2].norm_type == 2.0) or set(table.scales) == {1.0})
        and all(
            "grad" not in p.stats or np.array_equal(p.stats["grad"][:, 0], p.stats["grad"][:, 1])
            for _, _, p in table.sources
        )
    )  # equal sums stay equal divided by the loss scale when they are both of squares
    if not table.with_values and all(
        "grad" not in p.counts or not p.counts["grad"].any() for _, _, p in table.sources
    ):
        counts = np.broadcast_to(np.zeros((1, 3), dtype=np.int64), (n, 3))
    else:
        counts = table.kind_counts("grad")[chosen]
    term, unknown = table.kind_term("grad", norm_type)
    unknown = unknown[chosen]
    grad = KindColumns(
        has=table.kind_has("grad")[chosen],
        sum_sq=table.kind_column("grad", 0 if same else 1)[chosen],
        max_abs=table.kind_column("grad", 2)[chosen],
        counts=counts,
        term=np.where(unknown, math.nan, term[chosen]) if unknown.any() else term[chosen],
        flags=unknown.astype(np.int8) * UNKNOWN | _nonfinite_flags(counts),
    )
    layout = table.layout[chosen]
    return StepTable(
        norm_type=norm_type,
        rank=table.rank[chosen],
        index=table.local[chosen],
        param=table.param[chosen],
        param_names=tuple(table.names),
        layout=layout,
        dtypes=frozenset(table.dtype_names)  # one dtype in the step (the common case): no pass
        if len(table.dtype_names) == 1 and n
        else frozenset(table.dtype_names[c] for c in np.unique(table.dtype[chosen]).tolist()),
        grad=grad,
        clipped=_clipped(table, chosen, norm_type),
        has_dots=has_products[chosen, 0] & has_products[chosen, 1],
        dot_pre_post=products[chosen, 0],
        dot_pre_pre=products[chosen, 1],
        has_update=has_products[chosen, 2],
        update_sum_sq=products[chosen, 2],
        numel=table.numel[chosen],
        distinct_layouts=bool(table.copies.max(initial=0) <= 1)
        or bool(np.unique(layout).size == layout.size),
        calls=_calls(step, table, chosen),
    )


def _calls(step: StepDump, table: PieceTable, chosen: slice | np.ndarray) -> tuple[KindColumns, ...]:
    """Per clip call, the pieces' per-call statistics (format 1.0's; format 1.1 holds none), when a
    rank made two or more calls."""
    clips = {rank: step.ranks[rank].clip for rank in step.ranks_present}
    if all(c is None or len(c.calls) < 2 for c in clips.values()):
        return ()
    width = max((len(s) for _, _, p in table.sources for s in p.extras.call_stats.values()), default=0)
    if not width:
        return ()
    rows = []  # per source: [pieces, calls, 8] call_rows
    for rank, _, pieces in table.sources:
        clip = clips[rank]
        scales = [call_scale(c) for c in (clip.calls if clip is not None else ())]
        found = np.zeros((len(pieces), width, 8))
        for at, stats in pieces.extras.call_stats.items():
            for call, s in enumerate(stats):
                scale = scales[call] if call < len(scales) else 1.0
                found[at, call] = call_row(s, table.read_norm_type, scale)
        rows.append(found)
    return call_columns(table._gather(lambda k, _: rows[k])[chosen])


def _clipped(table: PieceTable, chosen: slice | np.ndarray, norm_type: float) -> KindColumns | None:
    """The columns of the gradient after clipping; None when no piece holds it."""
    has = table.kind_has("grad_clipped")[chosen]
    if not has.any():
        return None
    term, unknown = table.kind_term("grad_clipped", norm_type)
    counts = table.kind_counts("grad_clipped")[chosen]
    return KindColumns(
        has=has,
        sum_sq=table.kind_column("grad_clipped", 1)[chosen],
        max_abs=table.kind_column("grad_clipped", 2)[chosen],
        counts=counts,
        term=term[chosen],
        flags=np.where(~has | unknown[chosen], UNKNOWN, _nonfinite_flags(counts)).astype(np.int8),
    )


def _nonfinite_flags(counts: np.ndarray) -> np.ndarray:
    """Per row of [n, 3] (nan, +inf, -inf) counts, its int8 NAN and INF bits."""
    infinite = (counts[:, 1] + counts[:, 2]) > 0
    flags: np.ndarray = (counts[:, 0] > 0).astype(np.int8) * NAN | infinite.astype(np.int8) * INF
    return flags
