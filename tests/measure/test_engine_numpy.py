"""The numpy engine: check and show never import torch, widening equals torch's own conversion,
and the kernel's sums stay within 1e-12 of exact float64 references."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from builders import assert_exact_sums
from hypothesis import given, settings
from hypothesis import strategies as st
from import_probe import matching, modules_gradaudit_imports

from gradaudit.capture.tensorstats import stats_of_tensor
from gradaudit.dumpfile.dtypes import STORAGE, widen
from gradaudit.measure.kernel import StatsSums, stats_of_array
from gradaudit.norms import norm_of_terms

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "sample_dumps" / "fsdp2_local_clip"

FINGERPRINT_RTOL = 1e-12
"""Capture (torch) and check (numpy) sum a chunk in different orders, so their fingerprints agree
to within this much of sum |x| (|w| <= 1), not bit for bit; replica tolerances are far looser."""


@pytest.mark.parametrize(
    "argv",
    [
        ["check", str(SAMPLE / "step_1")],
        ["check", str(SAMPLE / "step_1"), "--format", "json"],
        ["check", str(SAMPLE / "step_1"), "--format", "markdown", "--reference", str(SAMPLE / "reference")],
        ["show", str(SAMPLE / "step_1")],
    ],
    ids=["check", "check-json", "check-reference-markdown", "show"],
)
def test_check_and_show_run_without_ever_importing_torch(argv):
    code, modules = modules_gradaudit_imports(argv)
    assert code in (0, 1)
    assert matching(modules, ("torch", "gradaudit.capture")) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_every_bit_pattern_widens_exactly_as_torch_converts_it(dtype):
    torch_dtype = getattr(torch, dtype)
    if STORAGE[dtype].itemsize == 1:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch_dtype)
    else:
        values = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch_dtype)
    raw = values.view(torch.uint8).numpy().view(STORAGE[dtype])
    got, want = widen(raw, dtype), values.double().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite], want[finite])
    assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


finite64 = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e80, max_value=1e80)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(finite64 | st.sampled_from([math.nan, math.inf, -math.inf]), min_size=0, max_size=300),
    norm_type=st.sampled_from([1.0, 2.0, 3.5, math.inf]),
    chunk=st.sampled_from([1, 7, 64, 4096]),
)
def test_kernel_sums_are_within_1e_12_of_the_exact_sums_in_any_chunking(values, norm_type, chunk):
    stats = stats_of_array(np.array(values, dtype=np.float64), "float64", norm_type, chunk)
    assert_exact_sums(stats, values, norm_type)
    finite = [v for v in values if math.isfinite(v)]
    assert stats.fingerprint[0] == pytest.approx(math.fsum(finite), abs=1e-12 * math.fsum(map(abs, finite)))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    numel=st.integers(0, 20_000),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64"]),
    norm_type=st.sampled_from([2.0, 1.0, 3.0, math.inf]),
)
def test_numpy_statistics_agree_with_the_capture_side_torch_statistics(seed, numel, dtype, norm_type):
    values = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3).to(getattr(torch, dtype))
    if numel > 3 and dtype not in ("float8_e4m3fn",):
        values[1], values[2] = math.inf, math.nan
    raw = values.view(torch.uint8).numpy().view(STORAGE[dtype]) if numel else np.empty(0, STORAGE[dtype])
    got, want = stats_of_array(raw, dtype, norm_type), stats_of_tensor(values, norm_type)
    assert (got.numel, got.num_nan, got.num_posinf, got.num_neginf) == (
        want.numel,
        want.num_nan,
        want.num_posinf,
        want.num_neginf,
    )
    assert got.max_abs == want.max_abs
    for name in ("sum_sq", "sum_pow"):
        assert getattr(got, name) == pytest.approx(getattr(want, name), rel=1e-12)
    scale = float(values.double().nan_to_num(0.0, 0.0, 0.0).abs().sum())
    for a, b in zip(got.fingerprint, want.fingerprint, strict=True):
        assert abs(a - b) <= FINGERPRINT_RTOL * scale


def test_nonfinite_values_are_counted_once_and_zeroed_in_the_buffer():
    sums = StatsSums(2.0)
    chunk = np.array([1.0, math.nan, math.inf, -math.inf, -2.0])
    mask = sums.add(chunk, np.empty(5))
    assert mask is not None and mask.tolist() == [True, False, False, False, True]
    assert chunk.tolist() == [1.0, 0.0, 0.0, 0.0, -2.0]
    stats = sums.result(5)
    assert (stats.num_nan, stats.num_posinf, stats.num_neginf, stats.sum_sq, stats.max_abs) == (
        1,
        1,
        1,
        5.0,
        2.0,
    )


@settings(max_examples=200, deadline=None)
@given(
    terms=st.lists(
        st.floats(min_value=0.0, max_value=1.7e308, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=8,
    ),
    norm_type=st.sampled_from([1.0, 2.0, 3.0, 0.5]),
)
def test_the_norm_of_terms_is_finite_and_exact_whenever_the_norm_itself_fits_float64(terms, norm_type):
    exact_total = sum(Fraction(t) for t in terms)
    norm = norm_of_terms(terms, norm_type)
    log_norm = (
        (math.log(exact_total.numerator) - math.log(exact_total.denominator)) / norm_type
        if exact_total
        else None
    )
    if log_norm is None:
        assert norm == 0.0
    elif log_norm < -700.0:
        assert 0.0 <= norm < 1e-300  # below float64's normal range: underflows, as torch's would
    elif log_norm < 709.0:
        assert math.isfinite(norm)
        assert math.log(norm) == pytest.approx(log_norm, abs=1e-12) or norm == pytest.approx(
            math.exp(log_norm), rel=1e-12
        )
    elif log_norm > 710.0:
        assert norm == math.inf
