"""Who holds which elements of a parameter: overlaps and gaps among boxes, without comparing all pairs.

Every region becomes boxes (a flat range of a row-major N-D parameter is at most 2*ndim-1 boxes).
The last dimension is an interval sweep and the last two a rectangle sweep (rows as events, the
covered length of the columns in a segment tree), both O(k log k) for k boxes whatever the layout.
Higher dimensions are cut into slabs at every box boundary along the leading dimension; inside a
slab the set of boxes that span it is fixed, so the slab is the same problem one dimension down on
those boxes only, times the slab's thickness (consecutive slabs with the same boxes are solved
once). For the layouts sharding produces every box is active in O(1) slabs, so that stays
O(k log k); only 3-D or larger boxes in general position can cost more.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ..model import Box, FlatRange, Region

BoxTuple = tuple[tuple[int, ...], tuple[int, ...], Hashable]
"""(offsets, sizes, tag): one box and what it belongs to."""


@dataclass(frozen=True, kw_only=True)
class Coverage:
    num_gap_elements: int
    """Elements no box holds."""
    num_overlap_elements: int
    """Extra copies: an element held by n boxes counts n - 1."""
    overlapping_tags: frozenset
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

    def within(row: int, a: int, b: int) -> list:
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


def coverage(boxes: Sequence[BoxTuple], shape: Sequence[int]) -> Coverage:
    """Gaps and overlaps of `boxes` (all within `shape`) over the whole of `shape`."""
    shape = tuple(shape)
    nonempty = [b for b in boxes if all(s > 0 for s in b[1])]
    if any(s == 0 for s in shape):
        return Coverage(num_gap_elements=0, num_overlap_elements=0, overlapping_tags=frozenset())
    if not shape:
        gap, overlap = (0, len(nonempty) - 1) if nonempty else (1, 0)
        tags = {b[2] for b in nonempty} if len(nonempty) > 1 else set()
    else:
        gap, overlap, tags = _sweep(nonempty, shape, 0)
    return Coverage(num_gap_elements=gap, num_overlap_elements=overlap, overlapping_tags=frozenset(tags))


MAX_SLABS_NAMED = 32
"""In two dimensions, the boxes of at most this many overlapping slabs are named (counts stay exact)."""


def _sweep(boxes: list[BoxTuple], shape: tuple[int, ...], dim: int) -> tuple[int, int, set]:
    remaining = len(shape) - dim
    if remaining == 1:
        return _sweep_1d(boxes, shape[dim], dim)
    if remaining == 2:
        return _sweep_2d(boxes, shape[dim], shape[dim + 1], dim)
    rest = math.prod(shape[dim + 1 :])
    if not boxes:
        return shape[dim] * rest, 0, set()
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][dim])
    cuts = sorted(
        {0, shape[dim]}
        | {boxes[i][0][dim] for i in order}
        | {boxes[i][0][dim] + boxes[i][1][dim] for i in order}
    )
    gap = overlap = 0
    tags: set = set()
    memo: dict[frozenset, tuple[int, int, set]] = {}
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
            memo[key] = _sweep([boxes[i] for i in active], shape, dim + 1) if active else (rest, 0, set())
        sub_gap, sub_overlap, sub_tags = memo[key]
        gap += (b - a) * sub_gap
        overlap += (b - a) * sub_overlap
        tags |= sub_tags
    return gap, overlap, tags


def _events(boxes: list[BoxTuple], dim: int) -> list[tuple[int, int, int]]:
    """(position, +1 or -1, box) where each box starts and ends along `dim`, by position."""
    found = [(b[0][dim], 1, i) for i, b in enumerate(boxes)] + [
        (b[0][dim] + b[1][dim], -1, i) for i, b in enumerate(boxes)
    ]
    return sorted(found)


def _sweep_1d(boxes: list[BoxTuple], extent: int, dim: int) -> tuple[int, int, set]:
    """Intervals along the last dimension: a count of open intervals; each box is named at most once."""
    gap = overlap = count = previous = 0
    untagged: dict[int, None] = {}
    tags: set = set()
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

    @property
    def covered(self) -> int:
        return self.length[1]


DENSE_SWEEP_BUDGET = 200_000_000
"""Row positions x column segments up to which the rectangle sweep recounts the columns with numpy at
every row position (fast in practice); above it, the segment tree keeps every box at O(log k)."""


def _sweep_2d(boxes: list[BoxTuple], rows: int, cols: int, dim: int) -> tuple[int, int, set]:
    """Rectangles: sweep the rows; overlap = (sum of active widths - covered column length) per row slab."""
    if not boxes:
        return rows * cols, 0, set()
    num_positions = len({b[0][dim] for b in boxes} | {b[0][dim] + b[1][dim] for b in boxes})
    num_segments = len({b[0][dim + 1] for b in boxes} | {b[0][dim + 1] + b[1][dim + 1] for b in boxes}) + 1
    if num_positions * num_segments <= DENSE_SWEEP_BUDGET:
        return _sweep_2d_dense(boxes, rows, cols, dim)
    return _sweep_2d_tree(boxes, rows, cols, dim)


def _sweep_2d_dense(boxes: list[BoxTuple], rows: int, cols: int, dim: int) -> tuple[int, int, set]:
    """The rectangle sweep with the column counts kept as a difference array, summed by numpy at each row
    position: O(k log k + positions x segments) in C, with a few numpy calls per row position."""
    import numpy as np

    cuts = np.array(
        sorted({0, cols} | {b[0][dim + 1] for b in boxes} | {b[0][dim + 1] + b[1][dim + 1] for b in boxes})
    )
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
    tags: set = set()
    for a, b in zip(starts.tolist(), stops.tolist(), strict=False):
        here = int(position[a])
        span = here - previous
        if span:
            covered = int(segment_lengths[counts > 0].sum())
            gap += span * (cols - covered)
            overlap += span * (widths - covered)
            if widths > covered and named_slabs < MAX_SLABS_NAMED:
                active = np.flatnonzero((row_start <= previous) & (row_stop > previous)).tolist()
                tags |= _sweep_1d([boxes[j] for j in active], cols, dim + 1)[2]
                named_slabs += 1
        np.add.at(difference, lo[a:b], delta[a:b])
        np.add.at(difference, hi[a:b], -delta[a:b])
        counts = np.cumsum(difference[:-1])
        widths += int(width[a:b].sum())
        previous = here
    return gap + (rows - previous) * cols, overlap, tags


def _sweep_2d_tree(boxes: list[BoxTuple], rows: int, cols: int, dim: int) -> tuple[int, int, set]:
    """The rectangle sweep with the covered column length in a segment tree: O(log k) per box."""
    cuts = sorted({0, cols} | {b[0][dim + 1] for b in boxes} | {b[0][dim + 1] + b[1][dim + 1] for b in boxes})
    where = {x: i for i, x in enumerate(cuts)}
    tree = _CoveredLength(cuts)
    gap = overlap = widths = previous = named_slabs = 0
    active: dict[int, None] = {}
    tags: set = set()
    for position, delta, i in _events(boxes, dim):
        span = position - previous
        if span:
            covered = tree.covered
            gap += span * (cols - covered)
            overlap += span * (widths - covered)
            if widths > covered and named_slabs < MAX_SLABS_NAMED:
                tags |= _sweep_1d([boxes[j] for j in active], cols, dim + 1)[2]
                named_slabs += 1
        start, width = boxes[i][0][dim + 1], boxes[i][1][dim + 1]
        tree.add(where[start], where[start + width], delta)
        widths += delta * width
        if delta > 0:
            active[i] = None
        else:
            active.pop(i, None)
        previous = position
    return gap + (rows - previous) * cols, overlap, tags
