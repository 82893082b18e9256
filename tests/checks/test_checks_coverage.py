"""GA100-GA103: complete, consistent steps whose elements each have exactly one owner."""

import torch
from builders import box, check, clip, codes, finding, flat, not_checked, whole, write_step

from gradaudit.analysis.geometry import coverage, flat_range_boxes


def _two_row_shards(tmp_path, *, ranks=(0, 1), clips=None, offsets=((0, 0), (2, 0)), rows=(2, 2)):
    pieces = {r: [box("w", offsets[r], grad=torch.ones(rows[r], 3, dtype=torch.float64))] for r in ranks}
    return write_step(tmp_path, world_size=2, params={"w": (4, 3)}, pieces=pieces, clips=clips or clip(1.0))


def test_a_missing_rank_is_named_and_the_rest_is_still_audited(tmp_path):
    _two_row_shards(tmp_path, ranks=(0,))
    report = check(tmp_path)
    found = finding(report, "GA100")
    assert found.ranks == (1,)
    assert report.ranks_present == (0,) and len(report.ranks) == 1
    assert {"GA103", "GA201", "GA302"} <= not_checked(report)
    assert report.global_norm is None


def test_a_complete_step_raises_no_missing_rank_finding(tmp_path):
    _two_row_shards(tmp_path)
    assert "GA100" not in codes(check(tmp_path))


def test_a_missing_rank_holding_only_replicas_leaves_the_true_norm_known(tmp_path):
    g = torch.full((2,), 3.0, dtype=torch.float64)
    write_step(
        tmp_path,
        world_size=3,
        params={"w": (2,)},
        pieces={r: [whole("w", grad=g.clone())] for r in (0, 1)},
        clips=clip(1.0, reported_norm=float(g.norm())),
    )
    report = check(tmp_path)
    assert "GA100" in codes(report)
    assert abs(report.global_norm - float(g.norm())) < 1e-12


def test_ranks_with_different_max_norms_are_reported_as_disagreeing(tmp_path):
    _two_row_shards(tmp_path, clips={0: clip(1.0), 1: clip(0.5)})
    found = finding(check(tmp_path), "GA101")
    assert "max_norm" in found.message and found.ranks == (0, 1)


def test_ranks_that_agree_raise_no_metadata_finding(tmp_path):
    _two_row_shards(tmp_path)
    assert "GA101" not in codes(check(tmp_path))


def test_overlapping_shards_that_are_not_replicas_are_an_ownership_overlap(tmp_path):
    _two_row_shards(tmp_path, offsets=((0, 0), (1, 0)), rows=(2, 3))
    report = check(tmp_path)
    found = finding(report, "GA102")
    assert found.evidence["num_overlap_elements"] == 3 and found.ranks == (0, 1) and found.params == ("w",)


def test_identical_replicas_are_not_an_overlap(tmp_path):
    g = torch.ones(4, 3, dtype=torch.float64)
    write_step(
        tmp_path,
        world_size=2,
        params={"w": (4, 3)},
        pieces={r: [whole("w", grad=g.clone())] for r in (0, 1)},
        clips=clip(1.0),
    )
    assert {"GA102", "GA103"} & codes(check(tmp_path)) == set()


def test_rows_no_rank_holds_are_an_ownership_gap(tmp_path):
    _two_row_shards(tmp_path, offsets=((0, 0), (3, 0)), rows=(2, 1))
    found = finding(check(tmp_path), "GA103")
    assert found.evidence["num_gap_elements"] == 3 and found.params == ("w",)


def test_flat_and_box_pieces_that_tile_a_parameter_leave_no_gap_or_overlap(tmp_path):
    pieces = {
        0: [flat("w", 0, grad=torch.ones(5, dtype=torch.float64))],
        1: [
            flat("w", 5, grad=torch.ones(1, dtype=torch.float64)),
            box("w", (2, 0), grad=torch.ones(2, 3, dtype=torch.float64)),
        ],
    }
    write_step(tmp_path, world_size=2, params={"w": (4, 3)}, pieces=pieces, clips=clip(1.0))
    assert {"GA102", "GA103"} & codes(check(tmp_path)) == set()


def test_flat_ranges_become_few_boxes_that_hold_exactly_their_elements():
    shape = (3, 4, 5)
    for start, stop in ((0, 60), (7, 53), (13, 14), (20, 40), (1, 59)):
        boxes = flat_range_boxes(start, stop, shape)
        assert len(boxes) <= 2 * len(shape) - 1
        held = torch.zeros(shape, dtype=torch.int64)
        for offsets, sizes in boxes:
            held[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=False))] += 1
        expected = torch.zeros(60, dtype=torch.int64)
        expected[start:stop] = 1
        assert torch.equal(held.reshape(-1), expected)


def test_the_coverage_sweep_of_many_column_shards_is_not_quadratic():
    import time

    k = 4000
    boxes = [((0, i), (1000, 1), i) for i in range(k)]
    started = time.perf_counter()
    result = coverage(boxes, (1000, k))
    assert result.num_gap_elements == 0 and result.num_overlap_elements == 0
    assert time.perf_counter() - started < 2.0


def test_with_a_rank_missing_a_clean_result_is_not_a_pass(tmp_path):
    _two_row_shards(tmp_path, ranks=(0,))
    report = check(tmp_path)
    missing = {n.code: n.reason for n in report.not_checked}
    assert {"GA102", "GA301", "GA401", "GA601"} <= set(missing)
    assert "some are missing (rank 1)" in missing["GA401"]
    assert "GA101" not in missing


def test_the_coverage_sweep_of_many_overlapping_strips_and_rows_is_not_quadratic():
    import time

    k = 3000
    columns = [((0, i), (2 * k, 1), ("col", i)) for i in range(k)]
    rows = [((2 * i, 0), (1, k), ("row", i)) for i in range(k)]
    started = time.perf_counter()
    result = coverage(columns + rows, (2 * k, k))
    assert result.num_overlap_elements == k * k and result.num_gap_elements == 0
    assert time.perf_counter() - started < 5.0


def test_the_coverage_of_flat_range_layouts_agrees_with_the_sweep():
    import random

    from gradaudit.analysis.coverage import _param_coverage
    from gradaudit.model import FlatRange

    rng = random.Random(7)
    for trial in range(300):
        numel = rng.randint(0, 60)
        cuts = sorted(rng.randint(0, numel) for _ in range(rng.randint(0, 8)))
        ranges = [(a, b) for a, b in zip([0, *cuts], [*cuts, numel], strict=True) if rng.random() < 0.8]
        if trial % 3 == 0 and numel:  # some layouts overlap
            a = rng.randint(0, numel - 1)
            ranges.append((a, rng.randint(a, numel)))
        holders = {(FlatRange(start=a, stop=b),): [i] for i, (a, b) in enumerate(dict.fromkeys(ranges))}
        shape = (numel,) if trial % 2 else (1, numel)
        swept = coverage([((a,), (b - a,), i) for i, (a, b) in enumerate(dict.fromkeys(ranges))], (numel,))
        assert _param_coverage(shape, holders)[0] == swept


def test_the_array_path_over_a_whole_parameter_merges_replicas_and_agrees_with_the_sweep():
    import random

    from gradaudit.analysis.coverage import _flat_param_coverage, _param_coverage
    from gradaudit.model import FlatRange, ParamInfo

    rng = random.Random(11)
    for trial in range(300):
        numel = rng.randint(0, 50)
        cuts = sorted(rng.randint(0, numel) for _ in range(rng.randint(0, 6)))
        ranges = [(a, b) for a, b in zip([0, *cuts], [*cuts, numel], strict=True) if rng.random() < 0.85]
        if trial % 4 == 0 and numel:
            a = rng.randint(0, numel - 1)
            ranges.append((a, rng.randint(a, numel)))
        held = [(a, b, rank) for rank, (a, b) in enumerate(ranges)]
        held += [(a, b, rank + 100) for a, b, rank in held if rng.random() < 0.3]  # replicas
        info = ParamInfo(name="w", global_shape=(numel,), dtype="float32")
        holders: dict = {}
        for a, b, rank in held:
            holders.setdefault((FlatRange(start=a, stop=b),), []).append(rank)
        fast = _flat_param_coverage(
            info, ([a for a, _, _ in held], [b for _, b, _ in held], [r for _, _, r in held]), {}
        )
        layouts = list(holders)
        swept = coverage([((r.start,), (r.numel,), tag) for tag, (r,) in enumerate(layouts)], (numel,))
        if fast is None:
            assert swept.num_overlap_elements > 0
            assert _param_coverage(info.global_shape, holders)[0] == swept
        else:
            assert fast[1:] == (swept, [], sorted({r for _, _, r in held}))
