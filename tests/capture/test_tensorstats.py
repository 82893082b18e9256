"""The capture side's statistics: exact float64 sums of the finite values in any chunking, nonfinite
values counted in whichever chunk they fall, and the fingerprint of its definition."""

from __future__ import annotations

import math

import pytest
import torch
from builders import assert_exact_sums
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.capture.tensorstats import (
    CPU_CHUNK_ELEMENTS,
    FINGERPRINT_PERIOD,
    StatsAccumulator,
    fingerprint_weights,
    stats_of_tensor,
)

finite64 = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e80, max_value=1e80)


def _fingerprint_by_definition(values: list[float]) -> tuple[float, float]:
    weights = fingerprint_weights("cpu").tolist()
    finite = [(i, v) for i, v in enumerate(values) if math.isfinite(v)]
    return (
        math.fsum(v for _, v in finite),
        math.fsum(v * weights[i % FINGERPRINT_PERIOD] for i, v in finite),
    )


@settings(max_examples=120, deadline=None)
@given(
    values=st.lists(finite64 | st.sampled_from([math.nan, math.inf, -math.inf]), min_size=0, max_size=300),
    norm_type=st.sampled_from([1.0, 2.0, 3.5, math.inf]),
    chunk=st.sampled_from([1, 7, 64, 4096, None]),
)
def test_statistics_are_the_exact_sums_of_the_finite_values_in_any_chunking(values, norm_type, chunk):
    stats = stats_of_tensor(torch.tensor(values, dtype=torch.float64), norm_type, chunk)
    assert stats.numel == len(values)
    assert_exact_sums(stats, values, norm_type)
    scale = math.fsum(abs(v) for v in values if math.isfinite(v))
    for got, want in zip(stats.fingerprint, _fingerprint_by_definition(values), strict=True):
        assert abs(got - want) <= 1e-12 * scale


def test_a_nonfinite_value_in_one_chunk_of_many_is_counted_and_the_other_chunks_keep_their_sums():
    values = torch.randn(3 * CPU_CHUNK_ELEMENTS + 1234, generator=torch.Generator().manual_seed(3))
    values[CPU_CHUNK_ELEMENTS + 17] = math.nan
    values[CPU_CHUNK_ELEMENTS + 18] = -math.inf
    values[-1] = math.inf
    stats = stats_of_tensor(values, 2.0)
    finite = values.double()[torch.isfinite(values)]
    assert (stats.num_nan, stats.num_posinf, stats.num_neginf) == (1, 1, 1)
    assert stats.sum_sq == pytest.approx(float(finite @ finite), rel=1e-12)
    assert stats.max_abs == float(finite.abs().max())
    want = _fingerprint_by_definition(values.double().tolist())
    assert stats.fingerprint == pytest.approx(want, rel=1e-9)


def test_chunks_fed_one_by_one_at_odd_offsets_give_the_statistics_of_the_whole_tensor():
    values = torch.randn(50_000, generator=torch.Generator().manual_seed(4)) * 5
    whole = stats_of_tensor(values, 3.0)
    acc = StatsAccumulator(3.0)
    for start, stop in [(0, 5), (5, 4101), (4101, 4200), (4200, 50_000)]:
        acc.add(values[start:stop])
    parts = acc.result()
    assert parts.numel == whole.numel
    assert parts.max_abs == whole.max_abs
    for name in ("sum_sq", "sum_pow"):
        assert getattr(parts, name) == pytest.approx(getattr(whole, name), rel=1e-12)
    assert parts.fingerprint == pytest.approx(whole.fingerprint, rel=1e-9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_narrow_dtypes_are_widened_exactly_before_summing(dtype):
    values = (torch.randn(10_001, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    wide = values.double()
    finite = wide[torch.isfinite(wide)]
    stats = stats_of_tensor(values, 1.0)
    assert stats.max_abs == float(finite.abs().max())
    assert stats.sum_pow == pytest.approx(math.fsum(finite.abs().tolist()), rel=1e-12)
    assert stats.sum_sq == pytest.approx(math.fsum((finite * finite).tolist()), rel=1e-12)


def test_rows_of_many_small_tensors_over_several_batches_and_given_groups_are_those_of_each_alone():
    from gradaudit.capture.tensorstats import CPU_BATCH_ELEMENTS, stats_rows

    generator = torch.Generator().manual_seed(4)
    count = CPU_BATCH_ELEMENTS // 4 + 77  # two batches of 4-element tensors
    tensors = [torch.randn(4, generator=generator) * 10 for _ in range(count)]
    tensors[3][1] = math.inf
    tensors += [torch.randn(2, 3, generator=generator).t() for _ in range(5)]  # non-contiguous
    alone = [stats_rows([t], 2.0)[0] for t in tensors]
    assert all((row == one).all() for row, one in zip(stats_rows(tensors, 2.0), alone, strict=True))
    chosen = {((4,), torch.float32, torch.device("cpu")): list(range(1, count, 2))}
    given = stats_rows(tensors, 2.0, chosen)
    assert all((given[i] == alone[i]).all() for i in range(1, count, 2))
    assert not given[0::2].any() and not given[count:].any()  # in no group: zeros
