"""Who holds which elements of a parameter: overlaps and gaps among boxes, without comparing all pairs.

Every region becomes boxes (a flat range of a row-major N-D parameter is at most 2*ndim-1 boxes).
The sweep cuts dimension 0 at every box boundary into slabs; inside a slab the set of boxes that
span it is fixed, so the slab is the same problem one dimension down, on those boxes only, and the
result is multiplied by the slab's thickness. Consecutive slabs with the same boxes are solved once.
For the layouts sharding produces (row shards, column shards, grids of both, flat shards) every box
is active in O(1) slabs, so the cost is O(k log k) for k boxes; only boxes in general position (a
staircase) make it grow faster, bounded by k^ndim slabs.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Hashable, Sequence

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


def flat_range_boxes(start: int, stop: int, shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
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
    gap, overlap, tags = _sweep(nonempty, shape, 0)
    return Coverage(num_gap_elements=gap, num_overlap_elements=overlap, overlapping_tags=frozenset(tags))


def _sweep(boxes: list[BoxTuple], shape: tuple[int, ...], dim: int) -> tuple[int, int, set]:
    if dim == len(shape):
        if not boxes:
            return 1, 0, set()
        return 0, len(boxes) - 1, ({b[2] for b in boxes} if len(boxes) > 1 else set())
    rest = math.prod(shape[dim + 1 :])
    if not boxes:
        return shape[dim] * rest, 0, set()
    order = sorted(range(len(boxes)), key=lambda i: boxes[i][0][dim])
    cuts = sorted({0, shape[dim]} | {boxes[i][0][dim] for i in order} | {boxes[i][0][dim] + boxes[i][1][dim] for i in order})
    gap = overlap = 0
    tags: set = set()
    memo: dict[frozenset, tuple[int, int, set]] = {}
    active: dict[int, None] = {}
    ends: list[tuple[int, int]] = []
    next_start = 0
    for a, b in zip(cuts, cuts[1:]):
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
