"""The guard's common path: the ranks' rows summed into one fixed-size vector settle a step only where
the full diagnosis of the same rows finds nothing wrong, with the numbers of the trend line it writes;
any disagreement (a wrong norm, a coefficient, a replica's bits, a nonfinite piece, a stamp) leaves the
step to the full diagnosis."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.capture.arguments import CallRecord
from gradaudit.live.analysis_input import CallSummary, LiveStep, OwnershipGroup, RankSummary, report_of
from gradaudit.live.fastpath import Reduction, role_of
from gradaudit.live.summary import GRAD_DTYPES, HEADER, VectorLayout, pack, stamped
from gradaudit.live.trend import trend_line
from gradaudit.model import Topology

MAX_NORM = 1.0
WORLD = 4
GROUPS = (
    OwnershipGroup(name="rep", replica_group="rep"),
    OwnershipGroup(name="sharded", replica_group=None),
)
TOPOLOGY = Topology(groups={"rep": ((0, 2), (1, 3))})
"""HSDP on 2 x 2: each rank's shard of the replicated group has one replica; the rest is its own."""
HELD = [(True, True)] * WORLD


def _coef(norm: float, max_norm: float = MAX_NORM) -> float:
    return min(1.0, max_norm / (norm + 1e-6))


def rows_of(terms, reported, coefs, *, nonfinite=(), calls=1, dtype="float32", stamps=None, passed=MAX_NORM):
    """Every rank's row as the guard packs it: `terms[r]` its sums of squares per group."""
    layout = VectorLayout(num_groups=len(GROUPS))
    rows = []
    for rank in range(WORLD):
        nan = [1.0 if (rank, g) in nonfinite else 0.0 for g in range(len(GROUPS))]
        local = torch.tensor([*terms[rank], *nan, 0.0, 0.0], dtype=torch.float64)
        call = CallRecord(
            terms=local[: len(GROUPS)],
            reported=torch.tensor(reported[rank], dtype=torch.float64),
            max_norm=passed,
            norm_type=2.0,
            coef=None,
            before=None,
        )
        vector = pack(
            layout,
            device="cpu",
            terms=local,
            applied_coef=coefs[rank],
            calls=[call] * calls,
            num_calls=calls,
            grad_dtype=dtype,
        )
        step, clock = (stamps or {}).get(rank, (5, 5))
        rows.append(stamped(vector, step=step, clock=clock, changed=False).numpy())
    return layout, np.stack(rows)


def fast_of(layout, rows, max_norm=MAX_NORM):
    reduction = Reduction(layout=layout)
    roles = [role_of(rank, GROUPS, HELD, [TOPOLOGY] * WORLD) for rank in range(WORLD)]
    summed = sum(reduction.contribution(rows[rank], roles[rank], max_norm) for rank in range(WORLD))
    return reduction.verdict(summed, norm_type=2.0, max_norm=max_norm)


def slow_of(layout, rows, max_norm=MAX_NORM):
    ranks = layout.unpack_rows(rows, held=HELD, topologies=[TOPOLOGY] * WORLD)
    live = LiveStep(step=5, world_size=WORLD, max_norm=max_norm, norm_type=2.0, groups=GROUPS, ranks=ranks)
    report = report_of(live)
    codes = tuple(sorted({f.code for f in report.findings if f.severity.name == "ERROR"}))
    return codes, trend_line(report, codes)


def correct(shards, replicated):
    """Ranks 0 and 2 hold one copy of the replicated group, 1 and 3 the other; each its own shard."""
    terms = [(replicated[rank % 2], shards[rank]) for rank in range(WORLD)]
    true = math.sqrt(math.fsum(replicated) + math.fsum(shards))
    return terms, [true] * WORLD, [_coef(true)] * WORLD, true


def test_a_correct_step_is_settled_by_the_sum_with_the_full_diagnosis_numbers():
    terms, reported, coefs, true = correct((0.4, 0.9, 1.3, 0.2), (0.7, 0.5))
    layout, rows = rows_of(terms, reported, coefs)
    fast = fast_of(layout, rows)
    codes, line = slow_of(layout, rows)
    assert codes == () and fast is not None and fast.kind == "passed"
    assert fast.true_norm == pytest.approx(line.true_norm, rel=1e-12)
    assert fast.true_norm == pytest.approx(true, rel=1e-12)
    assert fast.reported_norm == line.reported_norm
    assert fast.expected_coef == pytest.approx(line.expected_coef, rel=1e-12)
    assert fast.min_coef == fast.max_coef == coefs[0]  # the same bits on every rank: exact


@pytest.mark.parametrize(
    ("mistake", "code"),
    [
        ("local", "GA201"),
        ("one_coefficient", "GA301"),
        ("replica_bit", "GA601"),
        ("nonfinite", "GA401"),
    ],
)
def test_a_mistake_leaves_the_step_to_the_full_diagnosis_which_names_it(mistake, code):
    terms, reported, coefs, _ = correct((0.4, 0.9, 1.3, 0.2), (0.7, 0.5))
    nonfinite = ()
    if mistake == "local":
        reported = [math.sqrt(sum(terms[rank])) for rank in range(WORLD)]
        coefs = [_coef(r) for r in reported]
    elif mistake == "one_coefficient":
        coefs = [coefs[0]] * 3 + [coefs[0] * 0.5]
    elif mistake == "replica_bit":
        flipped = np.array([terms[2][0]]).view(np.uint64) ^ np.uint64(1 << 51)
        terms[2] = (float(flipped.view(np.float64)[0]), terms[2][1])
    elif mistake == "nonfinite":
        nonfinite = ((1, 1),)
    layout, rows = rows_of(terms, reported, coefs, nonfinite=nonfinite)
    assert fast_of(layout, rows) is None
    assert code in slow_of(layout, rows)[0]


def test_ranks_out_of_step_or_with_another_number_of_calls_are_not_settled_by_the_sum():
    terms, reported, coefs, _ = correct((0.4, 0.9, 1.3, 0.2), (0.7, 0.5))
    assert fast_of(*rows_of(terms, reported, coefs, stamps={3: (6, 6)})) is None
    assert fast_of(*rows_of(terms, reported, coefs, stamps={1: (5, 6)})) is None
    assert fast_of(*rows_of(terms, reported, coefs, calls=2)) is None  # GA501: the full diagnosis says it


def test_the_sum_is_the_same_size_for_any_world_and_the_step_at_max_norm_is_left_to_the_diagnosis():
    layout = VectorLayout(num_groups=len(GROUPS))
    assert Reduction(layout=layout).size < 200  # floats, whatever the number of ranks
    shards = (0.25, 0.25, 0.25, 0.25 - 1e-7)
    terms, reported, coefs, true = correct(shards, (0.0, 0.0))
    assert true == pytest.approx(MAX_NORM, rel=1e-6)
    assert fast_of(*rows_of(terms, reported, coefs)) is None  # what clipping leaves behind: GA504's ground


@settings(max_examples=150, deadline=None)
@given(
    shards=st.lists(st.floats(1e-6, 10.0), min_size=WORLD, max_size=WORLD),
    replicated=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=2),
    scale=st.sampled_from([1.0, 1.0 + 1e-9, 1.0 + 2e-6, 1.0 + 3e-5, 1.0 + 1e-3, 0.5, 2.0]),
    where=st.sampled_from(["reported", "coef_one_rank", "replica", "max_norm_passed", "none"]),
    dtype=st.sampled_from(["float32", "bfloat16", "float64"]),
)
def test_whatever_the_sum_settles_the_full_diagnosis_passes_with_the_same_numbers(
    shards, replicated, scale, where, dtype
):
    terms, reported, coefs, true = correct(shards, replicated)
    passed = MAX_NORM
    if where == "reported":
        reported = [r * scale for r in reported]
    elif where == "coef_one_rank":
        coefs = [*coefs[:3], coefs[3] * scale]
    elif where == "replica":
        terms[3] = (terms[3][0] * scale, terms[3][1])
    elif where == "max_norm_passed":
        passed = MAX_NORM * scale
        coefs = [_coef(true, passed)] * WORLD
    layout, rows = rows_of(terms, reported, coefs, dtype=dtype, passed=passed)
    fast = fast_of(layout, rows)
    subnormal = any(0.0 < term < 1e-290 for term in replicated)  # left to the full diagnosis
    if where == "none" and abs(true - MAX_NORM) > 1e-3 and not subnormal:
        assert fast is not None  # a correct step away from max_norm: the sum settles it
    if fast is None:
        return
    codes, line = slow_of(layout, rows, max_norm=fast.max_norm)
    assert codes == ()
    assert fast.true_norm == pytest.approx(line.true_norm, rel=1e-12)
    assert fast.reported_norm == line.reported_norm
    assert fast.expected_coef == pytest.approx(line.expected_coef, rel=1e-12)
    assert fast.min_coef <= line.min_coef * (1 + 1e-12) and line.max_coef <= fast.max_coef * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_groups=st.integers(0, 3),
    nan_chance=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_every_rank_unpacked_at_once_is_each_row_unpacked(seed, num_groups, nan_chance):
    """unpack_rows (the gathered matrix a column at a time) gives what the row oracle gives row by row:
    the numbers, the None of a nan, the calls each rank made (none, some, more than MAX_CALLS)."""
    rng = np.random.default_rng(seed)
    layout = VectorLayout(num_groups=num_groups)
    world = 7
    rows = rng.uniform(-2.0, 2.0, (world, layout.size))
    rows[rng.random(rows.shape) < nan_chance] = math.nan
    rows[:, 1] = rng.integers(-1, layout.max_calls + 3, world)  # clip calls
    counts = slice(10 + num_groups, 10 + 3 * num_groups)
    rows[:, counts] = rng.integers(0, 5, (world, 2 * num_groups))
    rows[:, 4:6] = np.where(np.isnan(rows[:, 4:6]), math.nan, rng.integers(0, 2, (world, 2)))
    rows[:, 6] = np.where(np.isnan(rows[:, 6]), math.nan, rng.integers(0, 3, world))
    held = [tuple(bool(x) for x in rng.integers(0, 2, num_groups)) for _ in range(world)]
    topologies = [Topology(groups={"g": ((r, (r + 1) % world),)}) for r in range(world)]
    expected = {
        rank: unpack_row(layout, rows[rank], rank=rank, held=held[rank], topology=topologies[rank])
        for rank in range(world)
    }
    found = layout.unpack_rows(rows, held=held, topologies=topologies)
    assert repr(found) == repr(expected)  # repr: a nan term is not equal to itself
    assert any(s.calls for s in expected.values()) or (rows[:, 1] <= 0).all()


def test_a_count_that_is_not_an_integer_is_refused():
    layout = VectorLayout(num_groups=1)
    rows = np.zeros((2, layout.size))
    rows[1, 1] = math.nan  # clip calls
    with pytest.raises(ValueError, match="not an integer"):
        layout.unpack_rows(rows, held=[(True,), (True,)], topologies=[Topology()] * 2)


def _optional(value):
    return None if math.isnan(value) else value


def unpack_row(layout, row, *, rank, held, topology):
    """One rank's RankSummary from its row, read one number at a time: the oracle of unpack_rows."""
    row = row.tolist()
    g, h = layout.num_groups, HEADER
    num_calls = int(row[1])
    calls = []
    for k in range(min(num_calls, layout.max_calls)):
        at = layout.call_offset(k)
        numbers = [_optional(x) for x in row[at : at + 4]]
        calls.append(
            CallSummary(
                reported_norm=numbers[0],
                max_norm=numbers[1],
                norm_type=numbers[2],
                coef=numbers[3],
                terms=tuple(row[at + 4 : at + 4 + g]),
            )
        )
    flags = [None if math.isnan(x) else bool(x) for x in row[4:6]]
    return RankSummary(
        rank=rank,
        terms=tuple(row[h : h + g]),
        held=held,
        num_nan=tuple(int(x) for x in row[h + g : h + 2 * g]),
        num_inf=tuple(int(x) for x in row[h + 2 * g : h + 3 * g]),
        applied_coef=_optional(row[2]),
        loss_scale=_optional(row[3]),
        unscaled=flags[0],
        skipped=flags[1],
        grad_dtype=None if math.isnan(row[6]) else GRAD_DTYPES[int(row[6])],
        calls=tuple(calls),
        num_calls=num_calls,
        topology=topology,
    )
