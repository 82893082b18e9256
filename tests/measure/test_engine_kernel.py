"""The check's numpy chunk kernel gives the statistics of the capture side's torch accumulator, in any dtype and chunking."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from builders import flat, write_one_rank
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.capture.tensorstats import stats_of_tensor
from gradaudit.dumpfile import TensorReader, load_step
from gradaudit.measure.kernel import ChunkKernel, StatsSums


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn]
)
def test_kernel_statistics_and_pair_sums_match_the_accumulator_with_nonfinite_values(tmp_path, dtype):
    gen = torch.Generator().manual_seed(1)
    grad = (torch.randn(70_001, generator=gen) * 3).to(dtype)
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no infinities
        grad[5], grad[7], grad[60_000] = math.nan, math.inf, -math.inf
    clipped = (grad.float() * 0.5).to(dtype)
    clipped[9] = math.nan
    write_one_rank(
        tmp_path,
        params={"w": (70_001,)},
        pieces=[flat("w", 0, grad=grad, grad_clipped=clipped)],
    )
    step = load_step(tmp_path)
    piece = step.ranks[0].pieces[0]
    with TensorReader(step) as reader:
        for norm_type in (2.0, 1.0, 3.5, math.inf):
            stats, pre_post, pre_pre, update = ChunkKernel(1 << 14).read_piece(
                reader, step.ranks[0].path, piece.tensors, piece.numel, norm_type
            )
            for kind, values in (("grad", grad), ("grad_clipped", clipped)):
                got, want = stats[kind], stats_of_tensor(values, norm_type)
                assert (got.num_nan, got.num_posinf, got.num_neginf) == (
                    want.num_nan,
                    want.num_posinf,
                    want.num_neginf,
                )
                for field in ("sum_pow", "sum_sq", "max_abs"):
                    assert getattr(got, field) == pytest.approx(getattr(want, field), rel=1e-12)
                assert got.fingerprint == ()
    a, b = grad.double(), clipped.double()
    both = torch.isfinite(a) & torch.isfinite(b)
    a, b = torch.where(both, a, 0.0), torch.where(both, b, 0.0)
    assert pre_post == pytest.approx(float(a @ b), rel=1e-12) and pre_pre == pytest.approx(
        float(a @ a), rel=1e-12
    )
    assert update is None


def test_fingerprints_are_computed_only_when_asked_for_and_then_equal_the_accumulators(tmp_path):
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(2))
    write_one_rank(
        tmp_path,
        params={"w": (10_000,)},
        pieces=[flat("w", 0, grad=values)],
    )
    step = load_step(tmp_path)
    piece = step.ranks[0].pieces[0]
    with TensorReader(step) as reader:
        stats, *_ = ChunkKernel(1 << 12).read_piece(
            reader, step.ranks[0].path, piece.tensors, piece.numel, 2.0, fingerprint=True
        )
    want = stats_of_tensor(values, 2.0).fingerprint
    assert len(stats["grad"].fingerprint) == len(want) > 0
    assert stats["grad"].fingerprint == pytest.approx(want, rel=1e-9)


def test_the_measurement_chunk_is_the_kernel_chunk():
    from gradaudit.measure.kernel import KERNEL_CHUNK_ELEMENTS
    from gradaudit.measure.measure import CHUNK_ELEMENTS

    assert CHUNK_ELEMENTS == KERNEL_CHUNK_ELEMENTS


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(["float16", "float32"]),
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=16), min_size=1, max_size=40),
    chunk=st.integers(min_value=1, max_value=16),
)
def test_min_and_max_read_from_the_dumped_floats_give_the_statistics_of_the_widened_chunk(
    dtype: str, values: list[float], chunk: int
) -> None:
    narrow_all = np.array(values, dtype=dtype)
    from_narrow, from_wide = StatsSums(2.0), StatsSums(2.0)
    for start in range(0, narrow_all.size, chunk):
        narrow = narrow_all[start : start + chunk]
        with np.errstate(all="ignore"):
            from_narrow.add(narrow.astype(np.float64), np.empty(narrow.size), narrow)
            from_wide.add(narrow.astype(np.float64), np.empty(narrow.size))
    got, want = from_narrow.result(narrow_all.size), from_wide.result(narrow_all.size)
    assert got == want
    assert math.copysign(1.0, got.max_abs) == 1.0
