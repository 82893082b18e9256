"""Ownership coverage of N-D boxes stays exact and bounded in any number of dimensions."""

from __future__ import annotations

import copy
import itertools
import math
import random
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.analysis.geometry import _Budget, _union, coverage

from .cli import no_hang, run_cli
from .corpus import edit_metadata, rank_path, write_valid_step

BoxTuple = tuple[tuple[int, ...], tuple[int, ...], int]


def _brute_force(shape: tuple[int, ...], boxes: list[BoxTuple], unit: int = 1) -> tuple[int, int, set[int]]:
    """Gaps, extra copies and overlapping tags by counting every element (of a grid of `unit`-sided blocks)."""
    grid = tuple(n // unit for n in shape)
    counts = np.zeros(grid, dtype=np.int64)

    def where(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(o // unit, (o + s) // unit) for o, s in zip(offsets, sizes, strict=True))

    for offsets, sizes, _ in boxes:
        counts[where(offsets, sizes)] += 1
    tags = {tag for offsets, sizes, tag in boxes if bool((counts[where(offsets, sizes)] > 1).any())}
    block = unit ** len(shape)
    return int((counts == 0).sum()) * block, int((counts - 1).clip(min=0).sum()) * block, tags


def _random_boxes(rng: random.Random, shape: tuple[int, ...], count: int, unit: int = 1) -> list[BoxTuple]:
    boxes = []
    for tag in range(count):
        offsets = tuple(unit * rng.randrange(n // unit) for n in shape)
        sizes = tuple(unit * rng.randint(1, (n - o) // unit) for n, o in zip(shape, offsets, strict=True))
        boxes.append((offsets, sizes, tag))
    return boxes


def _measured(shape: tuple[int, ...], boxes: list[BoxTuple]) -> tuple[int, int, set[int]]:
    result = coverage(boxes, shape)
    return result.num_gap_elements, result.num_overlap_elements, set(result.overlapping_tags)


def _common(boxes: tuple[BoxTuple, ...]) -> int:
    """Elements held by every one of `boxes`."""
    return math.prod(
        max(0, min(o + s for o, s in zip(offs, sizes, strict=True)) - max(offs))
        for offs, sizes in zip(
            zip(*(b[0] for b in boxes), strict=True), zip(*(b[1] for b in boxes), strict=True), strict=True
        )
    )


def test_32_random_boxes_of_a_ten_dimensional_parameter_are_measured_at_once():
    shape = (32,) * 10
    boxes = _random_boxes(random.Random(12), shape, 32)
    pairs = [(a, b) for a, b in itertools.combinations(boxes, 2) if _common((a, b))]
    assert pairs and not any(_common(three) for three in itertools.combinations(boxes, 3))
    volumes = sum(math.prod(b[1]) for b in boxes)
    twice = sum(_common(pair) for pair in pairs)
    tags = {box[2] for pair in pairs for box in pair}
    assert _measured(shape, boxes) == (32**10 - volumes + twice, twice, tags)


def test_overlapping_boxes_of_a_ten_dimensional_parameter_are_counted_exactly():
    shape = (32,) * 10
    for seed in range(3):
        boxes = _random_boxes(random.Random(seed), shape, 32, unit=8)
        expected = _brute_force(shape, boxes, unit=8)
        assert expected[1] > 0
        assert _measured(shape, boxes) == expected


def test_200_random_boxes_of_a_four_dimensional_parameter_are_counted_exactly():
    shape = (32,) * 4
    boxes = _random_boxes(random.Random(4), shape, 200)
    assert _measured(shape, boxes) == _brute_force(shape, boxes)


def test_200_boxes_in_general_position_in_a_large_four_dimensional_parameter_are_counted_exactly():
    shape = (1000,) * 4
    boxes = _random_boxes(random.Random(5), shape, 200, unit=50)
    assert _measured(shape, boxes) == _brute_force(shape, boxes, unit=50)


def test_thousands_of_three_dimensional_shards_with_one_missing_leave_exactly_its_gap():
    shape = (40, 40, 52)
    boxes = [
        ((2 * i, 2 * j, 4 * k), (2, 2, 4), (i, j, k)) for i in range(20) for j in range(20) for k in range(13)
    ]
    assert len(boxes) > 4096
    assert _measured(shape, boxes) == (0, 0, set())
    doubled = boxes[1:] + [((0, 0, 0), (2, 2, 8), "twice")]
    assert _measured(shape, doubled) == (0, 16, {"twice", (0, 0, 1)})


@st.composite
def _small_nd_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], list[BoxTuple]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=3, max_size=5)))
    boxes = []
    for tag in range(draw(st.integers(0, 14))):
        offsets = tuple(draw(st.integers(0, n - 1)) for n in shape)
        sizes = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offsets, strict=True))
        boxes.append((offsets, sizes, tag))
    return shape, boxes


@settings(max_examples=300, deadline=None)
@given(case=_small_nd_cases())
def test_coverage_in_three_to_five_dimensions_equals_a_count_of_every_element(case):
    shape, boxes = case
    assert _measured(shape, boxes) == _brute_force(shape, boxes)


def _step_of_boxes(root: Path, shape: tuple[int, ...], boxes: list[BoxTuple]) -> Path:
    """One rank holding one stats-only parameter as the given boxes (an 11 KB file for 32 boxes)."""
    step_dir = write_valid_step(root / "step_7", stats_only=True)
    rank_path(step_dir, 1).unlink()

    def one_parameter(doc: dict) -> None:
        piece = doc["pieces"][0]
        doc["world_size"] = 1
        doc["topology"] = {"groups": {"dp": [[0]]}, "norm_group": "dp"}
        doc["params"] = [{"dtype": "float32", "global_shape": list(shape), "name": "w"}]
        doc["pieces"] = []
        for offsets, sizes, _ in boxes:
            edited = copy.deepcopy(piece)
            edited["local_shape"] = list(sizes)
            edited["regions"] = [{"box": {"offsets": list(offsets), "shape": list(sizes)}}]
            for stats in edited["stats"].values():
                stats["numel"] = math.prod(sizes)
            doc["pieces"].append(edited)

    edit_metadata(rank_path(step_dir, 0), one_parameter)
    return step_dir


def test_check_answers_for_the_eleven_kilobyte_ten_dimensional_dump_that_hung(tmp_path, capsys):
    shape = (32,) * 10
    boxes = _random_boxes(random.Random(12), shape, 32)
    step_dir = _step_of_boxes(tmp_path, shape, boxes)
    with no_hang(120):
        outcome = run_cli(capsys, "check", str(step_dir))
    assert outcome.code == 1, outcome.stderr
    assert "GA102" in outcome.stdout and "GA103" in outcome.stdout


def test_boxes_no_sharding_produces_are_refused_in_bounded_time_with_one_line(tmp_path, capsys):
    """32 boxes of half the extent at random offsets in 10 dimensions all overlap each other: measuring
    their union is Klee's measure problem in 10-D; gradaudit gives up after its work budget."""
    shape = (32,) * 10
    rng = random.Random(1)
    boxes = [(tuple(rng.randrange(17) for _ in shape), (16,) * 10, tag) for tag in range(32)]
    step_dir = _step_of_boxes(tmp_path, shape, boxes)
    with no_hang(120):
        outcome = run_cli(capsys, "check", str(step_dir))
    assert outcome.code == 2 and outcome.stdout == ""
    assert len(outcome.stderr_lines) == 1
    assert str(step_dir) in outcome.stderr and "'w'" in outcome.stderr and "10 dimensions" in outcome.stderr


@settings(max_examples=200, deadline=None)
@given(
    case=_small_nd_cases(), dense_cells=st.sampled_from([0, 64]), exclusion_boxes=st.sampled_from([0, 3, 14])
)
def test_every_way_of_measuring_a_union_agrees_with_a_count_of_every_element(
    case, dense_cells, exclusion_boxes
):
    """Small cases are counted densely at once; these force the cuts, slab removal and inclusion-exclusion."""
    shape, boxes = case
    if not boxes:
        return
    lo = np.array([b[0] for b in boxes], dtype=np.int64)
    hi = lo + np.array([b[1] for b in boxes], dtype=np.int64)
    budget = _Budget(None, dense_cells=dense_cells, exclusion_boxes=exclusion_boxes)
    union = _union(lo, hi, np.zeros(len(shape), dtype=np.int64), np.array(shape, dtype=np.int64), budget)
    gap, _, _ = _brute_force(shape, boxes)
    assert union == math.prod(shape) - gap
