"""Who holds which elements of a parameter: overlaps and gaps among boxes, without comparing all pairs.

Every region becomes boxes (a flat range of a row-major N-D parameter is at most 2*ndim-1 boxes).
The last dimension is an interval sweep and the last two a rectangle sweep (rows as events, the
covered length of the columns in a segment tree), both O(k log k) for k boxes whatever the layout.
Dimensions that every box spans whole are dropped first, so a parameter sharded along at most two
dimensions is one of those sweeps. Otherwise the dimensions are cut into slabs at every box boundary
along the leading one; inside a slab the set of boxes that span it is fixed, so the slab is the same
problem one dimension down (consecutive slabs with the same boxes are solved once). For the layouts
sharding produces every box is active in O(1) slabs, so that stays O(k log k).

Boxes in general position in three or more dimensions (Klee's measure problem, #P-hard when the
number of dimensions is unbounded) make the slabs explode, so the slab sweep has a work budget; past
it, `_intricate` takes over: overlapping boxes are found by comparing pairs (O(k^2 d), numpy), split
into connected groups, and the union of each group is measured by cutting its cell in half at a
median box boundary until the cell is covered by one box, holds one box, has a small compressed grid
(counted densely) or few boxes (inclusion-exclusion). Every cut strictly shrinks the compressed grid,
so the work is at most O((2k+1)^d) cells, polynomial in k for any fixed d; a second budget turns the
truly unreasonable into `CoverageTooIntricate` instead of a hang.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import GradauditError
from ..model import Box, FlatRange, Region

BoxTuple = tuple[tuple[int, ...], tuple[int, ...], Hashable]
"""(offsets, sizes, tag): one box and what it belongs to."""

_Counts = tuple[int, int, set[Hashable]]
"""(gap elements, extra copies, tags of the boxes in an overlap)."""


@dataclass(frozen=True, kw_only=True)
class Coverage:
    num_gap_elements: int
    """Elements no box holds."""
    num_overlap_elements: int
    """Extra copies: an element held by n boxes counts n - 1."""
    overlapping_tags: frozenset[Hashable]
    """Tags of the boxes involved in any overlap."""


def flat_range_boxes(
    start: int, stop: int, shape: Sequence[int]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes that make up elements [start, stop) of a row-major tensor of `shape`."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), ())]
    if len(shape) == 1:
        return [((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    first_row, first_in = divmod(start, inner)
    last_row, last_in = divmod(stop, inner)

    def within(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row,) + o, (1,) + s) for o, s in flat_range_boxes(a, b, shape[1:])]

    if first_row == last_row:
        return within(first_row, first_in, last_in)
    boxes = []
    if first_in:
        boxes += within(first_row, first_in, inner)
        first_row += 1
    if last_row > first_row:
        boxes.append(((first_row,) + (0,) * (len(shape) - 1), (last_row - first_row,) + shape[1:]))
    if last_in:
        boxes += within(last_row, 0, last_in)
    return boxes


def region_boxes(region: Region, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if isinstance(region, FlatRange):
        return flat_range_boxes(region.start, region.stop, shape)
    assert isinstance(region, Box)
    return [] if region.numel == 0 else [(tuple(region.offsets), tuple(region.shape))]


class CoverageTooIntricate(GradauditError):
    """The boxes of one parameter would take unreasonably long to measure exactly."""


def coverage(boxes: Sequence[BoxTuple], shape: Sequence[int]) -> Coverage:
    """Gaps and overlaps of `boxes` (all within `shape`) over the whole of `shape`."""
    shape = tuple(shape)
    nonempty = [b for b in boxes if all(s > 0 for s in b[1])]
    if any(s == 0 for s in shape):
        return Coverage(num_gap_elements=0, num_overlap_elements=0, overlapping_tags=frozenset())
    kept = [d for d, n in enumerate(shape) if any(b[0][d] != 0 or b[1][d] != n for b in nonempty)]
    scale = math.prod(n for d, n in enumerate(shape) if d not in kept)
    if len(kept) < len(shape):
        shape = tuple(shape[d] for d in kept)
        nonempty = [(tuple(b[0][d] for d in kept), tuple(b[1][d] for d in kept), b[2]) for b in nonempty]
    if not shape:
        gap, overlap = (0, len(nonempty) - 1) if nonempty else (1, 0)
        tags: set[Hashable] = {b[2] for b in nonempty} if len(nonempty) > 1 else set()
    elif len(shape) <= 2:
        gap, overlap, tags = _sweep(nonempty, shape, 0, _Budget(None))
    elif len(nonempty) <= MAX_PAIRED_BOXES:
        gap, overlap, tags = _intricate(nonempty, shape)
    else:
        try:
            gap, overlap, tags = _sweep(nonempty, shape, 0, _Budget(SLAB_BUDGET))
        except _OverBudget:
            gap, overlap, tags = _intricate(nonempty, shape)
    return Coverage(
        num_gap_elements=gap * scale, num_overlap_elements=overlap * scale, overlapping_tags=frozenset(tags)
    )


MAX_PAIRED_BOXES = 4096
"""Boxes in three or more dimensions up to which `_intricate` (comparing pairs) runs at once."""

SLAB_BUDGET = 40_000_000
"""Work units of the slab sweep (boxes per slab, row positions and cells of its rectangle sweeps)
before `_intricate` takes over."""

MAX_INTRICATE_BOXES = 20_000
"""Boxes in three or more dimensions, in general position, beyond which coverage is refused."""

INTRICATE_BUDGET = 40_000_000
"""Work units (a box coordinate in a cell, four compressed grid cells, an inclusion-exclusion term) for
`_intricate`: about 2 s on one core. Sharding layouts never get here; past it is a heap of boxes no sharding produces."""

DENSE_CELLS = 1 << 20
"""Compressed grid points (cut points per dimension, multiplied) up to which a cell's union is counted densely with numpy."""

MAX_EXCLUSION_BOXES = 10
"""Boxes up to which a cell's union is measured by inclusion-exclusion (at most 2^10 terms)."""


class _OverBudget(Exception):
    pass


class _Budget:
    """Work allowed and spent, and the sizes below which `_union` counts densely or by exclusion."""

    def __init__(
        self, limit: int | None, *, dense_cells: int = DENSE_CELLS, exclusion_boxes: int = MAX_EXCLUSION_BOXES
    ) -> None:
        self.limit = limit
        self.spent = 0
        self.dense_cells = dense_cells
        self.exclusion_boxes = exclusion_boxes

    def spend(self, units: int) -> None:
        self.spent += units
        if self.limit is not None and self.spent > self.limit:
            raise _OverBudget


MAX_SLABS_NAMED = 32
"""In two dimensions, the boxes of at most this many overlapping slabs are named (counts stay exact)."""


def _sweep(boxes: list[BoxTuple], shape: tuple[int, ...], dim: int, budget: _Budget) -> _Counts:
    budget.spend(len(boxes) + 1)
    remaining = len(shape) - dim
    if remaining == 1:
        return _sweep_1d(boxes, shape[dim], dim)
    if remaining == 2:
        return _sweep_2d(boxes, shape[dim], shape[dim + 1], dim, budget)
    rest = math.prod(shape[dim + 1 :])
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][dim])
    cuts = sorted({0, shape[dim]} | _ends(boxes, dim))
    gap = overlap = 0
    tags: set[Hashable] = set()
    memo: dict[frozenset[int], _Counts] = {}
    active: dict[int, None] = {}
    ends: list[tuple[int, int]] = []
    next_start = 0
    for a, b in itertools.pairwise(cuts):
        while next_start < len(order) and boxes[order[next_start]][0][dim] <= a:
            i = order[next_start]
            active[i] = None
            heapq.heappush(ends, (boxes[i][0][dim] + boxes[i][1][dim], i))
            next_start += 1
        while ends and ends[0][0] <= a:
            active.pop(heapq.heappop(ends)[1], None)
        key = frozenset(active)
        if key not in memo:
            memo[key] = (
                _sweep([boxes[i] for i in active], shape, dim + 1, budget) if active else (rest, 0, set())
            )
        sub_gap, sub_overlap, sub_tags = memo[key]
        gap += (b - a) * sub_gap
        overlap += (b - a) * sub_overlap
        tags |= sub_tags
    return gap, overlap, tags


def _ends(boxes: list[BoxTuple], dim: int) -> set[int]:
    """Where the boxes start and stop along `dim`."""
    return {b[0][dim] for b in boxes} | {b[0][dim] + b[1][dim] for b in boxes}


def _events(boxes: list[BoxTuple], dim: int) -> list[tuple[int, int, int]]:
    """(position, +1 or -1, box) where each box starts and ends along `dim`, by position."""
    found = [(b[0][dim], 1, i) for i, b in enumerate(boxes)] + [
        (b[0][dim] + b[1][dim], -1, i) for i, b in enumerate(boxes)
    ]
    return sorted(found)


def _sweep_1d(boxes: list[BoxTuple], extent: int, dim: int) -> _Counts:
    """Intervals along the last dimension: a count of open intervals; each box is named at most once."""
    gap = overlap = count = previous = 0
    untagged: dict[int, None] = {}
    tags: set[Hashable] = set()
    events = _events(boxes, dim)
    for k, (position, delta, i) in enumerate(events):
        span = position - previous
        if count == 0:
            gap += span
        elif count > 1:
            overlap += span * (count - 1)
        count += delta
        if delta > 0:
            untagged[i] = None
        else:
            untagged.pop(i, None)
        previous = position
        if count > 1 and (k + 1 == len(events) or events[k + 1][0] != position):
            tags.update(boxes[j][2] for j in untagged)
            untagged.clear()
    return gap + extent - previous, overlap, tags


class _CoveredLength:
    """Segment tree over the cut points of one dimension: covered length under range additions."""

    def __init__(self, cuts: list[int]) -> None:
        self.cuts = cuts
        self.size = len(cuts) - 1
        self.count = [0] * (4 * self.size)
        self.length = [0] * (4 * self.size)

    def add(self, lo: int, hi: int, delta: int) -> None:
        """Add `delta` to the segments [lo, hi) (indices into the cut points)."""
        self._add(1, 0, self.size, lo, hi, delta)

    def _add(self, node: int, left: int, right: int, lo: int, hi: int, delta: int) -> None:
        if hi <= left or right <= lo:
            return
        if lo <= left and right <= hi:
            self.count[node] += delta
        else:
            middle = (left + right) // 2
            self._add(2 * node, left, middle, lo, hi, delta)
            self._add(2 * node + 1, middle, right, lo, hi, delta)
        if self.count[node] > 0:
            self.length[node] = self.cuts[right] - self.cuts[left]
        elif right - left == 1:
            self.length[node] = 0
        else:
            self.length[node] = self.length[2 * node] + self.length[2 * node + 1]


DENSE_SWEEP_BUDGET = 200_000_000
"""Row positions x column segments up to which the rectangle sweep recounts the columns with numpy at
every row position (fast in practice); above it, a segment tree keeps every box at O(log k)."""


def _sweep_2d(boxes: list[BoxTuple], rows: int, cols: int, dim: int, budget: _Budget) -> _Counts:
    """Rectangles: sweep the rows; overlap = (sum of active widths - covered column length) per row slab.
    The column counts are kept as a difference array, summed by numpy at each row position (O(k log k +
    positions x segments) in C, a few numpy calls per row position); above DENSE_SWEEP_BUDGET the
    covered column length is kept in a segment tree instead (O(log k) per box)."""
    if not boxes:
        return rows * cols, 0, set()
    import numpy as np

    num_positions, num_segments = len(_ends(boxes, dim)), len(_ends(boxes, dim + 1)) + 1
    budget.spend(30 * num_positions + num_positions * num_segments // 16)
    cuts = np.array(sorted({0, cols} | _ends(boxes, dim + 1)))
    tree = None if num_positions * num_segments <= DENSE_SWEEP_BUDGET else _CoveredLength(cuts.tolist())
    segment_lengths = np.diff(cuts)
    row_start = np.array([b[0][dim] for b in boxes], dtype=np.int64)
    row_stop = row_start + np.array([b[1][dim] for b in boxes], dtype=np.int64)
    col_start = np.array([b[0][dim + 1] for b in boxes], dtype=np.int64)
    col_stop = col_start + np.array([b[1][dim + 1] for b in boxes], dtype=np.int64)
    first, last = np.searchsorted(cuts, col_start), np.searchsorted(cuts, col_stop)
    position = np.concatenate([row_start, row_stop])
    delta = np.concatenate([np.ones(len(boxes), dtype=np.int64), -np.ones(len(boxes), dtype=np.int64)])
    lo, hi = np.concatenate([first, first]), np.concatenate([last, last])
    width = np.concatenate([col_stop - col_start, col_stop - col_start]) * delta
    order = np.argsort(position, kind="stable")
    position, delta, lo, hi, width = position[order], delta[order], lo[order], hi[order], width[order]
    bounds = np.flatnonzero(np.diff(position)) + 1
    starts = np.concatenate([[0], bounds])
    stops = np.concatenate([bounds, [len(position)]])
    difference = np.zeros(len(cuts), dtype=np.int64)
    counts = np.zeros(len(cuts) - 1, dtype=np.int64)
    gap = overlap = widths = previous = named_slabs = 0
    tags: set[Hashable] = set()
    for a, b in zip(starts.tolist(), stops.tolist(), strict=False):
        here = int(position[a])
        span = here - previous
        if span:
            covered = int(segment_lengths[counts > 0].sum()) if tree is None else tree.length[1]
            gap += span * (cols - covered)
            overlap += span * (widths - covered)
            if widths > covered and named_slabs < MAX_SLABS_NAMED:
                active = np.flatnonzero((row_start <= previous) & (row_stop > previous)).tolist()
                tags |= _sweep_1d([boxes[j] for j in active], cols, dim + 1)[2]
                named_slabs += 1
        if tree is None:
            np.add.at(difference, lo[a:b], delta[a:b])
            np.add.at(difference, hi[a:b], -delta[a:b])
            counts = np.cumsum(difference[:-1])
        else:
            for k in range(a, b):
                tree.add(int(lo[k]), int(hi[k]), int(delta[k]))
        widths += int(width[a:b].sum())
        previous = here
    return gap + (rows - previous) * cols, overlap, tags


def _intricate(boxes: list[BoxTuple], shape: tuple[int, ...]) -> _Counts:
    """Exact coverage of boxes in general position (see the module docstring), or CoverageTooIntricate."""
    import numpy as np

    k, ndim = len(boxes), len(shape)
    if k > MAX_INTRICATE_BOXES:
        raise CoverageTooIntricate(
            f"{k} boxes in {ndim} dimensions that no sharding layout explains (more than {MAX_INTRICATE_BOXES})"
        )
    budget = _Budget(INTRICATE_BUDGET)
    lo = np.array([b[0] for b in boxes], dtype=np.int64).reshape(k, ndim)
    hi = lo + np.array([b[1] for b in boxes], dtype=np.int64).reshape(k, ndim)
    total = math.prod(shape)
    sum_volume = sum(math.prod(b[1]) for b in boxes)
    try:
        budget.spend(k * k * ndim // 64)
        first, second = _intersecting_pairs(lo, hi, budget)
        involved = np.zeros(k, dtype=bool)
        involved[first] = involved[second] = True
        union = sum(math.prod(b[1]) for b, hit in zip(boxes, involved.tolist(), strict=True) if not hit)
        cell_lo, cell_hi = np.zeros(ndim, dtype=np.int64), np.array(shape, dtype=np.int64)
        for group in _groups(k, first, second):
            union += _union(lo[group], hi[group], cell_lo, cell_hi, budget)
    except _OverBudget:
        raise CoverageTooIntricate(
            f"{k} boxes in {ndim} dimensions overlap in a pattern that no sharding layout produces "
            f"(measuring it exactly would take more than {INTRICATE_BUDGET:,} steps)"
        ) from None
    tags = {b[2] for b, hit in zip(boxes, involved.tolist(), strict=True) if hit}
    return total - union, sum_volume - union, tags


def _intersecting_pairs(lo: Any, hi: Any, budget: _Budget) -> tuple[Any, Any]:
    """(i, j) with i < j for every two boxes that share an element, compared in blocks of rows; each
    pair kept costs 4 units, so the budget also bounds their memory (at most 10 million pairs)."""
    import numpy as np

    k = len(lo)
    firsts, seconds = [], []
    block = max(1, 4_000_000 // max(1, k * lo.shape[1]))
    for start in range(0, k, block):
        rows = slice(start, min(k, start + block))
        meets = np.all((lo[rows, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[rows, None, :]), axis=2)
        i, j = np.nonzero(meets)
        i += start
        keep = i < j
        budget.spend(4 * int(keep.sum()))
        firsts.append(i[keep])
        seconds.append(j[keep])
    return np.concatenate(firsts), np.concatenate(seconds)


def _groups(k: int, first: Any, second: Any) -> list[Any]:
    """Connected groups (two or more boxes) of the graph whose edges are the pairs (first, second)."""
    import numpy as np

    label = np.arange(k)
    while True:
        low = np.minimum(label[first], label[second])
        before = label.copy()
        np.minimum.at(label, first, low)
        np.minimum.at(label, second, low)
        label = label[label]
        if np.array_equal(label, before):
            break
    members = np.unique(np.concatenate([first, second]))
    order = members[np.argsort(label[members], kind="stable")]
    bounds = np.flatnonzero(np.diff(label[order])) + 1
    return [g for g in np.split(order, bounds) if len(g) > 1]


def _union(lo: Any, hi: Any, cell_lo: Any, cell_hi: Any, budget: _Budget) -> int:
    """Elements of the cell [cell_lo, cell_hi) held by at least one of the boxes [lo, hi)."""
    import numpy as np

    lo, hi = np.maximum(lo, cell_lo), np.minimum(hi, cell_hi)
    inside = np.all(hi > lo, axis=1)
    lo, hi = lo[inside], hi[inside]
    k, ndim = lo.shape
    budget.spend(k * ndim + 10)
    if k == 0:
        return 0
    if k == 1:
        return math.prod((hi[0] - lo[0]).tolist())
    spans = (lo == cell_lo) & (hi == cell_hi)
    num_spanned = spans.sum(axis=1)
    if bool(np.any(num_spanned == ndim)):
        return math.prod((cell_hi - cell_lo).tolist())
    slabs = num_spanned == ndim - 1
    if bool(np.any(slabs)):
        return _without_slabs(lo, hi, cell_lo, cell_hi, spans, slabs, budget)
    cuts = [
        np.unique(np.concatenate([lo[:, d], hi[:, d], cell_lo[d : d + 1], cell_hi[d : d + 1]]))
        for d in range(ndim)
    ]
    entries = math.prod(len(c) for c in cuts)
    if entries <= budget.dense_cells:
        budget.spend(entries * ndim // 8 + (k + 1000) * 2**ndim)
        return _dense_union(lo, hi, cuts)
    if k <= budget.exclusion_boxes:
        return _exclusion_union(lo.tolist(), hi.tolist(), budget)
    axis = max(range(ndim), key=lambda d: len(cuts[d]))
    middle = cuts[axis][len(cuts[axis]) // 2]
    left_hi, right_lo = cell_hi.copy(), cell_lo.copy()
    left_hi[axis] = right_lo[axis] = middle
    return _union(lo, hi, cell_lo, left_hi, budget) + _union(lo, hi, right_lo, cell_hi, budget)


def _without_slabs(
    lo: Any, hi: Any, cell_lo: Any, cell_hi: Any, spans: Any, slabs: Any, budget: _Budget
) -> int:
    """A slab spans the cell in every dimension but one: the union of the slabs along that dimension is
    wholly covered, so it is counted and cut out of the cell, and the rest is measured in a thinner cell."""
    import numpy as np

    axis = int(np.argmin(spans[np.flatnonzero(slabs)[0]]))
    along = slabs & ~spans[:, axis]
    order = np.argsort(lo[along, axis], kind="stable")
    a, b = lo[along, axis][order], hi[along, axis][order]
    joins = np.ones(a.size, dtype=bool)  # an interval starting past every earlier one's end: a new run
    joins[1:] = a[1:] > np.maximum.accumulate(b)[:-1]
    starts, stops = a[joins], np.maximum.reduceat(b, np.flatnonzero(joins))
    lengths = stops - starts

    def squeezed(x: Any) -> Any:
        """Coordinate x along the axis once the merged intervals are cut out."""
        before = np.searchsorted(stops, x, side="right")
        removed = np.concatenate([[0], np.cumsum(lengths)])[before]
        within = np.searchsorted(starts, x, side="right") > before
        return x - removed - np.where(within, x - starts[np.minimum(before, len(starts) - 1)], 0)

    rest = ~along
    lo, hi = lo[rest].copy(), hi[rest].copy()
    lo[:, axis], hi[:, axis] = squeezed(lo[:, axis]), squeezed(hi[:, axis])
    thin_hi = cell_hi.copy()
    thin_hi[axis] = squeezed(cell_hi[axis : axis + 1])[0]
    other: int = math.prod((cell_hi - cell_lo).tolist()) // int(cell_hi[axis] - cell_lo[axis])
    return int(lengths.sum()) * other + _union(lo, hi, cell_lo, thin_hi, budget)


def _dense_union(lo: Any, hi: Any, cuts: list[Any]) -> int:
    """Union over the compressed grid: a difference array with a +-1 at each box corner, summed per axis."""
    import numpy as np

    ndim = lo.shape[1]
    counts = np.zeros([len(c) for c in cuts], dtype=np.int64)
    starts = [np.searchsorted(cuts[d], lo[:, d]) for d in range(ndim)]
    stops = [np.searchsorted(cuts[d], hi[:, d]) for d in range(ndim)]
    for corner in itertools.product((0, 1), repeat=ndim):
        index = tuple(stops[d] if bit else starts[d] for d, bit in enumerate(corner))
        np.add.at(counts, index, -1 if sum(corner) % 2 else 1)
    for d in range(ndim):
        counts = np.cumsum(counts, axis=d)
    held = counts[tuple(slice(0, -1) for _ in range(ndim))] > 0
    volumes = functools.reduce(np.multiply, np.ix_(*(np.diff(c) for c in cuts)))  # of each grid cell
    return int(volumes[held].sum())


def _exclusion_union(lo: list[list[int]], hi: list[list[int]], budget: _Budget) -> int:
    """Inclusion-exclusion over the boxes, skipping every superset of a set whose intersection is empty."""
    k = len(lo)

    def terms(first: int, lower: list[int], upper: list[int], sign: int) -> int:
        found = 0
        for i in range(first, k):
            a = [max(x, y) for x, y in zip(lower, lo[i], strict=True)]
            b = [min(x, y) for x, y in zip(upper, hi[i], strict=True)]
            if all(y > x for x, y in zip(a, b, strict=True)):
                budget.spend(1)
                found += sign * math.prod(y - x for x, y in zip(a, b, strict=True))
                found += terms(i + 1, a, b, -sign)
        return found

    return sum(
        math.prod(y - x for x, y in zip(lo[i], hi[i], strict=True)) + terms(i + 1, lo[i], hi[i], -1)
        for i in range(k)
    )
