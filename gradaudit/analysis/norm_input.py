"""The diagnosis' input: the terms of the p-norm each rank holds, per entry (a piece of a loaded dump,
or an ownership group of the guard's gathered summary) and per clip call, whatever produced them, and
the one implementation of the norm of a set of entries (replicas once through the first rank's copy,
or every copy counted) that the true norm, the candidates, the per-call norms and the parameter-group
hypotheses all use.

`norm_input_of` builds it from the step table, whichever built that (measuring a loaded dump, or
the guard from its gathered summary).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..model import StepFacts
from ..norms import INF, NAN, UNKNOWN, is_inf_norm, norm_from_total, norm_of_terms, safe_fsum, segment_fsums
from ..steptable import KindColumns, StepMeasurements, StepTable


@dataclass(frozen=True, kw_only=True, eq=False)
class Entries:
    """Terms of the p-norm the ranks hold, one per entry, as columns in (rank, entry) order: among
    copies of one layout, the first is the lowest rank's."""

    rank: np.ndarray
    """int64, ascending: the rank holding the entry."""
    layout: np.ndarray
    """int64: entries with equal ids hold the same elements (replicas of each other)."""
    term: np.ndarray
    """float64: sum |x|^p of the entry (max |x| for the inf-norm; 0 for an entry without a gradient);
    meaningless where `flags` has UNKNOWN."""
    flags: np.ndarray
    """int8: the UNKNOWN, NAN and INF bits of the entry."""
    replicated: bool = True
    """Some layout is held by more than one entry (False: no replicas to look for)."""

    def subset(self, inside: np.ndarray) -> Entries:
        """The entries where the boolean `inside` is set."""
        return Entries(
            rank=self.rank[inside],
            layout=self.layout[inside],
            term=self.term[inside],
            flags=self.flags[inside],
            replicated=self.replicated,
        )


@dataclass(frozen=True, kw_only=True, eq=False)
class NormInput:
    """Everything numeric the diagnosis reads of a step (the clip records, the topology and the
    missing ranks it reads from the StepFacts)."""

    norm_type: float
    grad: Entries
    """The gradient before clipping (before the last clip call when there were several)."""
    param: np.ndarray
    """Per `grad` entry: its parameter (live: its ownership group), an index into `param_names`."""
    param_names: tuple[str, ...]
    sum_sq: np.ndarray
    """Per `grad` entry: sum x^2, of which each rank's share of the squared norm is taken."""
    clipped: Entries | None
    """The gradient after clipping, entry for entry as `grad` (UNKNOWN where an entry with a gradient
    lacks it); None when no entry has one."""
    calls: tuple[Entries, ...] = ()
    """Per clip call, when a rank made two or more: the gradient just before it, in true-gradient
    scale (the loss scale divided out of a call that ran before GradScaler.unscale_)."""
    dtypes: frozenset[str]
    """The entries' dtypes (the matching tolerance and the overflow hypotheses read them)."""
    measured_coef: Mapping[int, float]
    """Rank -> the clip coefficient measured on its gradients before and after clipping (nan when
    clipping turned finite values nonfinite); ranks where they do not give one are absent."""
    drifted: frozenset[int] = frozenset()
    """Ranks holding a copy of a replicated entry that is not exactly the lowest rank's copy."""
    covers_every_param: bool = True
    """The present ranks' distinct entries hold as many elements as every parameter has (whether
    missing ranks held parts of the gradient)."""


class NormSet:
    """The norm of the entries of any set of ranks: each layout once, through its copy on the first
    rank of the set, or every copy counted; every rank set computed once (groups are shared by their
    members). The one implementation of the norm of a set of entries."""

    def __init__(self, entries: Entries, norm_type: float) -> None:
        self.entries, self.norm_type = entries, norm_type
        rank = entries.rank
        starts = [0, *(np.flatnonzero(rank[1:] != rank[:-1]) + 1).tolist()] if rank.size else []
        ends = [*starts[1:], entries.rank.size][: len(starts)]
        self.spans = {int(entries.rank[b]): (b, e) for b, e in zip(starts, ends, strict=True)}
        """Rank -> the span of its entries (ranks without any absent)."""
        self._ranks = tuple(sorted(self.spans))
        self._cache: dict[tuple[tuple[int, ...], bool], tuple[float | None, bool]] = {}
        self._sums: dict[tuple[tuple[int, ...], bool], float] = {}
        """safe_fsum of the terms counted, by the same keys (shares_of_squared_norm reads them too)."""
        self._layouts: dict[tuple[int, ...], int] = {}

    def rows(self, ranks: Sequence[int], dedupe: bool) -> tuple[np.ndarray | slice, bool]:
        """(positions of the entries counted, whether a layout appears more than once among these
        ranks' entries), the ranks' entries taken in the order of `ranks`."""
        spans = [self.spans[r] for r in ranks if r in self.spans]
        if len(spans) == 1 or (spans and len(spans) == len(self.spans) and list(ranks) == sorted(ranks)):
            rows: np.ndarray | slice = slice(spans[0][0], spans[-1][1])  # contiguous, in order
        else:
            rows = np.concatenate([np.arange(b, e) for b, e in spans] or [np.zeros(0, dtype=np.int64)])
        if not self.entries.replicated:
            return rows, False
        layouts = self.entries.layout[rows]
        distinct, first_seen = np.unique(layouts, return_index=True)
        repeated = distinct.size < layouts.size
        if dedupe and repeated:  # each layout through its first copy
            chosen = np.sort(first_seen)
            rows = chosen + rows.start if isinstance(rows, slice) else rows[chosen]
        return rows, repeated

    def norm(
        self, ranks: Sequence[int], dedupe: bool, *, first: int | None = None
    ) -> tuple[float | None, bool]:
        """(norm, whether a layout appears more than once among these ranks); None when an entry's
        statistics cannot give this norm type, nan when any holds a nan, inf when any an infinity.
        With `first`, that rank's copies of replicated entries are the ones counted."""
        order = tuple(sorted(ranks))
        if first is not None:
            order = (first, *(r for r in order if r != first))
        key = (order, dedupe and self.entries.replicated)  # without replicas both ways are one
        if key not in self._cache:
            rows, repeated = self.rows(order, dedupe)
            self._cache[key] = (self.norm_of(rows, key), repeated)
        return self._cache[key]

    def prime(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """What `norm` (each layout once, and every copy counted) and `num_layouts` give for each of
        these rank sets, computed for all of them in a few numpy passes, as those compute them (the
        same rows, the same exact sums): the diagnosis asks them of every rank and group."""
        orders = [
            o for o in dict.fromkeys(tuple(sorted(s)) for s in rank_sets) if (o, False) not in self._cache
        ]
        if not orders or not self._ranks:
            return
        spans, held = self.spans, np.array(self._ranks, dtype=np.int64)
        first_row = np.array([spans[r][0] for r in self._ranks], dtype=np.int64)
        num_rows = np.array([spans[r][1] - spans[r][0] for r in self._ranks], dtype=np.int64)
        members = np.fromiter(itertools.chain.from_iterable(orders), dtype=np.int64)
        sizes = np.fromiter(map(len, orders), dtype=np.int64, count=len(orders))
        set_of = np.repeat(np.arange(len(orders)), sizes)
        at = np.searchsorted(held, members).clip(max=held.size - 1)
        present = held[at] == members
        begin, length = np.where(present, first_row[at], 0), np.where(present, num_rows[at], 0)
        size = np.bincount(set_of, weights=length, minlength=len(orders))
        usable = size > 0  # a set holding some entry, with no rank twice (a sorted set: neighbours)
        usable[set_of[1:][(members[1:] == members[:-1]) & (set_of[1:] == set_of[:-1])]] = False
        # chunks of about 2^18 rows: a few MiB of temporaries
        chunk_of = np.where(usable, (np.cumsum(size * usable) - size) // (1 << 18), -1).astype(np.int64)
        for chunk in np.unique(chunk_of[usable]).tolist():
            inside = chunk_of == chunk
            taken = inside[set_of]
            chosen = [orders[k] for k in np.flatnonzero(inside).tolist()]
            self._prime(chosen, begin[taken], length[taken], sizes[inside])

    def _prime(
        self, orders: list[tuple[int, ...]], begin: np.ndarray, length: np.ndarray, sizes: np.ndarray
    ) -> None:
        """Prime these rank sets, their members' (in order) first entry and number of entries given."""
        entries = self.entries
        ends = np.cumsum(length)
        rows = np.repeat(begin - ends + length, length) + np.arange(int(ends[-1]))
        of_set = np.repeat(np.repeat(np.arange(len(orders)), sizes), length)
        n = np.bincount(of_set, minlength=len(orders))
        every = self._primed(orders, rows, of_set, False)
        once, n_once = every, n
        if entries.replicated:
            key = of_set * (int(entries.layout.max()) + 1) + entries.layout[rows]
            first = np.sort(np.unique(key, return_index=True)[1])
            n_once = np.bincount(of_set[first], minlength=len(orders))
            # a set whose every entry is its layout's first copy counts the same rows both ways
            repeated = np.flatnonzero(n_once < n)
            once = list(every)
            if repeated.size:
                inside = np.zeros(len(orders), dtype=bool)
                inside[repeated] = True
                kept = first[inside[of_set[first]]]
                renumbered = np.cumsum(inside) - 1
                sub = [orders[k] for k in repeated.tolist()]
                values = self._primed(sub, rows[kept], renumbered[of_set[kept]], True)
                for k, value in zip(repeated.tolist(), values, strict=True):
                    once[k] = value
            for order, k in zip(orders, (n_once == n).tolist(), strict=True):
                if k and (order, False) in self._sums:
                    self._sums.setdefault((order, True), self._sums[(order, False)])
        shared = (n_once < n).tolist()
        self._cache.update(zip(((o, False) for o in orders), zip(every, shared, strict=True), strict=True))
        self._cache.update(zip(((o, True) for o in orders), zip(once, shared, strict=True), strict=True))
        self._layouts.update(zip(orders, n_once.tolist(), strict=True))

    def _primed(
        self, orders: list[tuple[int, ...]], rows: np.ndarray, of_set: np.ndarray, dedupe: bool
    ) -> list[float | None]:
        """Per rank set: the norm of the `rows` of each (`of_set`, ascending)."""
        starts = np.searchsorted(of_set, np.arange(len(orders)))
        bounds = [*starts.tolist(), rows.size]
        p, dedupe = self.norm_type, dedupe and self.entries.replicated
        if is_inf_norm(p):
            return [self.norm_of(rows[bounds[k] : bounds[k + 1]]) for k in range(len(orders))]
        flags = np.bitwise_or.reduceat(self.entries.flags[rows], starts)
        terms = self.entries.term[rows]
        totals = _small_sums(terms, starts)
        summed = np.isnan(totals)
        if summed.any():
            sizes = np.diff(bounds)
            lengths = summed * sizes  # of the segments summed exactly, 0 for the others
            inside = np.repeat(summed, sizes)
            exact, _ = segment_fsums(terms[inside], (np.cumsum(lengths) - lengths)[summed].tolist())
            totals[summed] = exact
        sums = totals.tolist()
        plain = (flags & (UNKNOWN | NAN | INF) == 0) & np.isfinite(totals)
        if p == 2.0:  # math.sqrt's correctly rounded root, for all at once
            found: list[float | None] = np.sqrt(np.where(plain, totals, 0.0)).tolist()
        elif p == 1.0:
            found = list(sums)
        else:
            found = [
                norm_from_total(t, p) if ok else None for t, ok in zip(sums, plain.tolist(), strict=True)
            ]
        clean = (flags & (UNKNOWN | NAN | INF) == 0).tolist()
        fresh = {(orders[k], dedupe): sums[k] for k in np.flatnonzero(clean).tolist()}
        kept = fresh.keys() & self._sums.keys()  # summed before: that sum is the one counted
        self._sums.update((key, total) for key, total in fresh.items() if key not in kept)
        redo = set(np.flatnonzero(~plain).tolist()) | {orders.index(key[0]) for key in kept}
        for k in sorted(redo):
            at = slice(bounds[k], bounds[k + 1])
            if not clean[k]:
                found[k] = self.norm_of(rows[at])
                continue
            total = self._sums[(orders[k], dedupe)]
            found[k] = norm_from_total(total, p) if math.isfinite(total) else norm_of_terms(terms[at], p)
        return found

    def num_layouts(self, ranks: Sequence[int]) -> int:
        """How many distinct layouts these ranks' entries hold (the whole step's, for every rank: a
        group holding fewer holds only part of the step's elements)."""
        order = tuple(sorted(ranks))
        if order not in self._layouts:
            rows, _ = self.rows(order, True)
            self._layouts[order] = rows.stop - rows.start if isinstance(rows, slice) else int(rows.size)
        return self._layouts[order]

    def norm_of(
        self, rows: np.ndarray | slice, key: tuple[tuple[int, ...], bool] | None = None
    ) -> float | None:
        """The norm of the entries at these positions, each counted: None with an UNKNOWN entry, nan
        with a NAN one, inf with an INF one (`key`: norm's, under which the sum of the terms is kept)."""
        flags = self.entries.flags[rows]
        found = int(np.bitwise_or.reduce(flags)) if flags.size else 0
        if found & UNKNOWN:
            return None
        if found & (NAN | INF):
            return math.nan if found & NAN else math.inf
        if key is not None and not is_inf_norm(self.norm_type):
            total = self.term_sum(key, rows)
            if math.isfinite(total):
                return norm_from_total(total, self.norm_type)
            # the plain sum overflows: norm_of_terms factors the largest term out
        return norm_of_terms(self.entries.term[rows], self.norm_type)

    def term_sum(self, key: tuple[tuple[int, ...], bool], rows: np.ndarray | slice) -> float:
        """safe_fsum of the terms at `rows`, the ones norm(*key) counts, computed once. Without
        replicas, every rank's own sum and the sum over all ranks are taken together, on first need."""
        ranks, spans = self._ranks, self.spans
        if (
            key not in self._sums
            and not (self.entries.replicated or key[1])
            and (len(key[0]) == 1 or key[0] == ranks)
            and ranks
            and (ranks, False) not in self._sums
        ):
            sums, total = segment_fsums(self.entries.term, [spans[r][0] for r in ranks])
            self._sums.update({((r,), False): value for r, value in zip(ranks, sums, strict=True)})
            self._sums[(ranks, False)] = total
        if key not in self._sums:
            self._sums[key] = safe_fsum(self.entries.term[rows])
        return self._sums[key]


def _small_sums(terms: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per segment of `terms` (from each start to the next): the sum of a segment of one or two
    values, as one float64 addition (correctly rounded: math.fsum's sum); nan where that does not
    stand for math.fsum's (more values, a nonfinite or zero sum: its sign) and where it overflows."""
    ends = np.append(starts[1:], terms.size)
    first = terms[starts]
    second = np.where(ends - starts == 2, terms[np.minimum(starts + 1, terms.size - 1)], 0.0)
    total = first + second
    return np.where((ends - starts <= 2) & np.isfinite(total) & (total != 0), total, np.nan)


def cover_norm(table: StepTable, at: np.ndarray, kind: KindColumns, norm_type: float) -> float | None:
    """The norm of these entries' `kind` (`at`: some of the cover's, in its order), each counted
    (NormSet's norm of their terms); any p the table's, or 2 from the sums of squares."""
    if norm_type == table.norm_type:
        term, flags = kind.term[at], kind.flags[at]
    else:
        counts = kind.counts[at]
        term = kind.sum_sq[at]
        flags = (counts[:, 0] > 0) * NAN | ((counts[:, 1] + counts[:, 2]) > 0) * INF
    entries = Entries(rank=table.rank[at], layout=table.layout[at], term=term, flags=flags.astype(np.int8))
    return NormSet(entries, norm_type).norm(sorted(set(entries.rank.tolist())), True)[0]


def param_signatures(norms: NormInput) -> dict[str, tuple[int, int]]:
    """Parameter -> (ranks holding an entry of it, most entries with one layout): how
    hypotheses.groups_of tells parameter groups apart."""
    grad = norms.grad
    pairs = np.unique(np.stack([norms.param, grad.rank], axis=1), axis=0)
    params, holders = np.unique(pairs[:, 0], return_counts=True)
    copies = np.bincount(grad.layout)[grad.layout]
    most = np.zeros(len(norms.param_names), dtype=np.int64)
    np.maximum.at(most, norms.param, copies)
    names = norms.param_names
    return {names[p]: (h, int(most[p])) for p, h in zip(params.tolist(), holders.tolist(), strict=True)}


def shares_of_squared_norm(norms: NormInput, ranks: Sequence[int], grad: NormSet) -> dict[int, float]:
    """Rank -> its part of the squared true norm: the sums of squares of its entries among each
    layout's first copies (`grad`: the NormSet of `norms.grad`)."""
    ordered = sorted(ranks)
    rows, _ = grad.rows(ordered, True)
    values, holders = norms.sum_sq[rows], norms.grad.rank[rows]
    bounds = np.searchsorted(holders, [*ordered, math.inf]).tolist()
    sums, total = segment_fsums(values, bounds[:-1])  # the first bound is 0: rows hold only these ranks
    return {rank: sums[k] / total if total > 0 else 0.0 for k, rank in enumerate(ordered)}


def norm_input_of(step: StepFacts, m: StepMeasurements, table: StepTable) -> NormInput:
    """The diagnosis' input from a loaded step's measurements and their step table."""
    order, grad_columns = table.by_rank_order, table.grad
    held = None if grad_columns.has.all() else grad_columns.has[order]

    def of_grad(values: np.ndarray, dtype: type) -> np.ndarray:
        """`values` in (rank, index) order, 0 where a piece holds no gradient (gathered once, at random)."""
        if not values.any():
            return np.zeros(order.size, dtype=dtype)
        chosen = values[order]
        return (chosen if held is None else np.where(held, chosen, 0)).astype(dtype, copy=False)

    rank = np.repeat(np.arange(table.rank.max(initial=-1) + 1), np.bincount(table.rank))  # rank[order]
    layout = table.layout[order]
    grad = Entries(
        rank=rank,
        layout=layout,
        term=of_grad(grad_columns.term, np.float64),
        flags=of_grad(grad_columns.flags, np.int8),
        replicated=not table.distinct_layouts,
    )
    clipped = None
    if table.clipped is not None:  # an entry with a gradient but no clipped one is UNKNOWN
        after = table.clipped
        clipped = Entries(
            rank=rank, layout=layout, term=after.term[order], flags=of_grad(after.flags, np.int8)
        )
    measured = _coefs_from_gradients(table) if table.clipped is not None or table.has_dots.any() else {}
    return NormInput(
        norm_type=m.norm_type,
        grad=grad,
        param=table.param[order],
        param_names=tuple(table.param_names),
        sum_sq=of_grad(grad_columns.sum_sq, np.float64),
        clipped=clipped,
        calls=tuple(
            Entries(rank=rank[has], layout=layout[has], term=c.term[order][has], flags=c.flags[order][has])
            for c in table.calls
            for has in [c.has[order]]
        ),
        dtypes=table.dtypes,
        measured_coef=measured,
        drifted=_ranks_with_drifted_replicas(m),
        covers_every_param=not step.missing_ranks or _covers_every_param(step, table),
    )


def _coefs_from_gradients(table: StepTable) -> dict[int, float]:
    """Rank -> the coefficient its gradients before and after clipping show: from their dot products
    (dense dumps), else from the ratio of their sums of squares; nan when clipping turned finite
    values nonfinite (ranks whose pieces tell neither: left out). Every rank's sums at once."""
    pre, post, order = table.grad, table.clipped, table.by_rank_order
    ranks, of_rank = np.unique(table.rank[order], return_inverse=True)

    def by_rank(values: np.ndarray, chosen: np.ndarray) -> dict[int, float]:
        """Rank -> safe_fsum of its `values` where `chosen` (in rank order), for ranks with any."""
        at = np.flatnonzero(chosen)
        owner = of_rank[at]
        starts = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1]))) if at.size else at
        sums, _ = segment_fsums(values[order[at]], starts.tolist())
        return dict(zip(ranks[owner[starts]].tolist(), sums, strict=True))

    dots = table.has_dots[order]  # dot_pre_pre is set together with dot_pre_post
    pre_pre, pre_post = by_rank(table.dot_pre_pre, dots), by_rank(table.dot_pre_post, dots)
    found = {rank: pre_post[rank] / d for rank, d in pre_pre.items() if d > 0}
    if post is not None:
        grad, pairs = pre.has[order], pre.has[order] & post.has[order]
        whole = np.bincount(of_rank, pairs, ranks.size) == np.bincount(of_rank, grad, ranks.size)
        nonfinite = [np.bincount(of_rank[pairs], k.nonfinite[order][pairs], ranks.size) for k in (pre, post)]
        before, after = by_rank(pre.sum_sq, pairs), by_rank(post.sum_sq, pairs)
        for k, rank in enumerate(ranks.tolist()):
            if rank in found or rank not in before or not whole[k]:
                continue
            if nonfinite[1][k] > nonfinite[0][k]:
                # a nan coefficient (from a nonfinite norm) turned finite values into nan
                found[rank] = math.nan
            elif before[rank] > 0:
                found[rank] = math.sqrt(after[rank] / before[rank])
    return dict(sorted(found.items()))


def _ranks_with_drifted_replicas(m: StepMeasurements) -> frozenset[int]:
    return frozenset(
        copy.rank
        for pm in m.params.values()
        for rs in pm.replica_sets
        for copy in rs.copies
        if (copy.max_abs_diff or 0.0) > 0
        or (copy.num_nonfinite_mismatch or 0) > 0
        or (copy.fingerprint_delta or 0.0) > 0
    )


def _covers_every_param(step: StepFacts, table: StepTable) -> bool:
    """Whether the present ranks' distinct entries hold as many elements as every parameter has
    (the exact overlap/gap check is GA102/GA103; this only tells whether missing ranks mattered)."""
    cover = table.cover
    sums = np.bincount(table.param[cover], weights=table.numel[cover], minlength=len(table.param_names))
    held = dict(zip(table.param_names, sums.tolist(), strict=True))
    return all(held.get(name, 0) >= info.numel for name, info in step.params.items())
