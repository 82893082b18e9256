"""The two rectangle sweeps of `geometry.coverage` agree with each other and with counting cells:
the numpy recount that runs in practice, and the segment tree that takes over above
DENSE_SWEEP_BUDGET (hostile layouts with tens of thousands of cut points), which no real dump reaches."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.analysis import geometry

_box = st.tuples(st.integers(0, 11), st.integers(0, 8), st.integers(1, 6), st.integers(1, 6))


def _cells(boxes, rows, cols):
    counts = np.zeros((rows, cols), dtype=np.int64)
    for (r, c), (h, w), _ in boxes:
        counts[r : r + h, c : c + w] += 1
    return int((counts == 0).sum()), int(np.maximum(counts - 1, 0).sum())


@settings(max_examples=200, deadline=None)
@given(st.lists(_box, min_size=1, max_size=12))
def test_the_segment_tree_sweep_counts_what_the_dense_sweep_and_the_cells_count(raw):
    rows, cols = 16, 14
    boxes = [((r, c), (min(h, rows - r), min(w, cols - c)), i) for i, (r, c, h, w) in enumerate(raw)]
    dense = geometry._sweep_2d(boxes, rows, cols, 0, geometry._Budget(None))
    saved, geometry.DENSE_SWEEP_BUDGET = geometry.DENSE_SWEEP_BUDGET, 0  # the segment tree from the start
    try:
        tree = geometry._sweep_2d(boxes, rows, cols, 0, geometry._Budget(None))
    finally:
        geometry.DENSE_SWEEP_BUDGET = saved
    assert tree[:2] == dense[:2] == _cells(boxes, rows, cols)
    assert tree[2] == dense[2]


def test_coverage_takes_the_segment_tree_above_the_budget_and_gives_the_same_answer(monkeypatch):
    boxes = [((0, 0), (4, 3), "a"), ((2, 1), (4, 4), "b"), ((5, 5), (1, 1), "c")]
    expected = geometry.coverage(boxes, (8, 6))
    taken = []
    real_tree = geometry._CoveredLength
    monkeypatch.setattr(geometry, "DENSE_SWEEP_BUDGET", 0)
    monkeypatch.setattr(geometry, "_CoveredLength", lambda cuts: taken.append(cuts) or real_tree(cuts))
    assert geometry.coverage(boxes, (8, 6)) == expected
    assert taken and expected.num_overlap_elements == 4 and expected.overlapping_tags == {"a", "b"}
