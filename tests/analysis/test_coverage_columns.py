"""The coverage of a step whose ranks each hold one flat range of the same parameters, found for all
parameters at once, against the per-parameter path (the oracle) on random layouts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.analysis.coverage import _flat_param_coverage, _pieces_by_param, _uniform_flat_ranges
from gradaudit.model import ParamInfo


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[list[ParamInfo], list[tuple[np.ndarray, ...]]]:
    num_params, num_ranks = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    numels = [draw(st.integers(0, 12)) for _ in range(num_params)]
    params = [ParamInfo(name=f"p{i}", global_shape=(n,), dtype="float32") for i, n in enumerate(numels)]
    ranges = []
    for n in numels:
        kind = draw(st.sampled_from(["shards", "replicas", "random"]))
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=num_ranks - 1, max_size=num_ranks - 1)))
        bounds = [0, *cuts, n]
        if kind == "shards":
            found = [(bounds[r], bounds[r + 1]) for r in range(num_ranks)]
            if draw(st.booleans()):
                found = draw(st.permutations(found))
        elif kind == "replicas":
            found = [(0, n)] * num_ranks
        else:
            found = [
                tuple(sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2))))
                for _ in range(num_ranks)
            ]
        ranges.append(found)
    order = draw(st.permutations(range(num_params)))
    columns = []
    for r in range(num_ranks):
        ids = np.array(order, dtype=np.int64)
        start = np.array([ranges[p][r][0] for p in order], dtype=np.int64)
        stop = np.array([ranges[p][r][1] for p in order], dtype=np.int64)
        columns.append((ids, start, stop, np.ones(num_params, dtype=bool), 10 + r))
    return params, columns


@settings(max_examples=300, deadline=None)
@given(_layouts())
def test_the_coverage_of_uniform_flat_ranges_equals_the_per_parameter_one(case):
    params, columns = case
    names = [p.name for p in params]
    ranks = np.array([c[4] for c in columns], dtype=np.int64)
    start, stop = np.stack([c[1] for c in columns]), np.stack([c[2] for c in columns])
    others, covered, holding = _uniform_flat_ranges(ranks, start, stop, columns[0][0], names)
    oracle = _pieces_by_param(columns, names)
    assert holding == sorted(c[4] for c in columns)
    assert set(others) | set(covered) == set(oracle) and not set(others) & set(covered)
    for info in params:
        expected = _flat_param_coverage(info, oracle[info.name], {})
        if info.name in covered:
            assert expected is not None
            assert expected[1].num_gap_elements == info.numel - covered[info.name]
        else:
            start, stop, ranks = others[info.name]
            want_start, want_stop, want_ranks = oracle[info.name]
            got = sorted(zip(start.tolist(), stop.tolist(), ranks.tolist(), strict=True))
            assert got == sorted(
                zip(want_start.tolist(), want_stop.tolist(), want_ranks.tolist(), strict=True)
            )


def test_a_step_of_flat_shards_with_one_gap_reports_that_gap_and_every_holder(tmp_path):
    import torch
    from builders import write_step

    from gradaudit.analysis.coverage import coverage_by_param
    from gradaudit.capture.build import flat
    from gradaudit.dumpfile import load_step

    pieces = {
        rank: [flat("a", 4 * rank, torch.ones(4)), flat("b", 3 * rank + (rank == 2), torch.ones(2))]
        for rank in range(3)
    }
    found = coverage_by_param(
        load_step(write_step(tmp_path, world_size=3, params={"a": (12,), "b": (9,)}, pieces=pieces))
    )
    assert found["a"][1].num_gap_elements == 0 and found["a"][3] == [0, 1, 2]
    assert found["b"][1].num_gap_elements == 3 and found["b"][3] == [0, 1, 2]
