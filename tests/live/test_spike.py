"""The guard's `spike=` rule (a factor over the recent median true norm, or the user's callable) and
the shares of Σg² its warning names: plain values, no torch."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradaudit.errors import GradauditError
from gradaudit.live.spike import (
    MIN_KNOWN,
    WINDOW,
    SpikeOptionError,
    SpikeRule,
    SpikeWatch,
    shares_text,
    spike_watch,
    top_shares,
)

NORMS = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False)


def _watch_after(norms: list[float], spike: float = 10.0) -> SpikeWatch:
    watch = spike_watch(spike)
    assert watch is not None
    for norm in norms:
        watch.observe(norm)
    return watch


def test_a_norm_above_the_factor_times_the_median_is_a_spike_and_one_at_it_is_not() -> None:
    watch = _watch_after([1.0, 2.0, 3.0, 100.0, 2.0])  # median 2, whatever the outlier
    assert not watch.is_spike(6, 20.0)
    assert watch.is_spike(6, 20.000001)


def test_the_median_is_of_the_last_window_norms_only() -> None:
    watch = _watch_after([100.0] * 30 + [1.0] * WINDOW)  # the hundreds have left the window
    assert watch.recent == (1.0,) * WINDOW
    assert watch.is_spike(51, 11.0)


def test_no_step_is_a_spike_before_five_norms_are_known() -> None:
    watch = _watch_after([1.0] * (MIN_KNOWN - 1))
    assert not watch.is_spike(MIN_KNOWN, 1e9)
    watch.observe(1.0)
    assert watch.is_spike(MIN_KNOWN + 1, 1e9)


def test_nonfinite_norms_never_enter_the_window_and_are_no_spike() -> None:
    watch = _watch_after([1.0, math.nan, math.inf, 1.0, None, 1.0, 1.0])  # type: ignore[list-item]
    assert watch.recent == (1.0, 1.0, 1.0, 1.0)
    assert not watch.is_spike(8, 1e9)  # four known: still warming up
    watch.observe(1.0)
    assert watch.is_spike(9, 1e9)
    assert not watch.is_spike(9, math.inf)
    assert not watch.is_spike(9, math.nan)
    assert not watch.is_spike(9, None)


def test_a_callable_decides_with_the_step_the_norm_and_the_recent_norms() -> None:
    seen = []

    def rule(step: int, true_norm: float, recent: tuple[float, ...]) -> bool:
        seen.append((step, true_norm, recent))
        return step == 7

    watch = spike_watch(rule)
    assert watch is not None
    for step, norm in enumerate([1.0, 2.0, 3.0, 4.0, 5.0], start=1):
        assert not watch.is_spike(step, norm)  # warming up: the callable is not asked
        watch.observe(norm)
    assert seen == []
    assert not watch.is_spike(6, 0.5)
    assert watch.is_spike(7, 0.5)
    assert seen == [(6, 0.5, (1.0, 2.0, 3.0, 4.0, 5.0)), (7, 0.5, (1.0, 2.0, 3.0, 4.0, 5.0))]


@given(st.lists(NORMS, min_size=MIN_KNOWN, max_size=3 * WINDOW), NORMS, st.floats(1.01, 100.0))
def test_the_factor_rule_is_exactly_norm_over_factor_times_the_median_of_the_window(
    norms: list[float], norm: float, factor: float
) -> None:
    watch = _watch_after(norms, factor)
    assert watch.is_spike(1, norm) == (norm > factor * statistics.median(norms[-WINDOW:]))


@pytest.mark.parametrize("bad", [1.0, 0.5, -3.0, math.nan, math.inf, True, "10", [10.0], 0])
def test_a_spike_that_is_no_factor_above_one_nor_a_callable_is_refused_with_the_way_to_write_it(
    bad: object,
) -> None:
    with pytest.raises(SpikeOptionError) as raised:
        spike_watch(bad)  # type: ignore[arg-type]
    message = str(raised.value)
    assert isinstance(raised.value, GradauditError)
    assert "\n" not in message
    assert "spike=10.0" in message and "callable" in message and repr(bad) in message


def test_no_spike_argument_watches_nothing_and_a_bad_window_is_refused() -> None:
    assert spike_watch(None) is None
    with pytest.raises(SpikeOptionError, match="at least 5"):
        SpikeRule.of(10.0, window=4)
    with pytest.raises(SpikeOptionError, match="exactly one"):
        SpikeRule(factor=10.0, test=lambda step, norm, recent: True)


def test_the_note_says_how_many_times_the_median_the_norm_is() -> None:
    watch = _watch_after([2.0] * 5)
    assert watch.note(53.0) == "true norm 53 is 26.5x the median 2 of the last 5 checked steps"


def test_top_shares_are_sorted_largest_first_and_name_the_parameter() -> None:
    shares = top_shares(["a", "b", "c", "d"], [9.0, 72.0, 10.0, 9.0])
    assert shares == (("b", 0.72), ("c", 0.10), ("a", 0.09))
    assert shares_text(shares) == "72% of Σg² in b, 10% in c, 9% in a"


def test_equal_shares_are_ordered_by_name_whatever_the_input_order() -> None:
    names = ["w3", "w1", "w2", "w0"]
    assert top_shares(names, [1.0] * 4, most=2) == (("w0", 0.25), ("w1", 0.25))
    assert top_shares(names[::-1], [1.0] * 4, most=2) == (("w0", 0.25), ("w1", 0.25))


def test_no_share_is_given_of_a_nonfinite_or_zero_sum_and_a_tiny_share_reads_below_one_percent() -> None:
    assert top_shares(["a", "b"], [1.0, math.inf]) == ()
    assert top_shares(["a", "b"], [1.0, math.nan]) == ()
    assert top_shares(["a", "b"], [0.0, 0.0]) == ()
    assert shares_text(()) == ""
    assert shares_text(top_shares(["big", "tiny"], [1e6, 1.0])) == "100% of Σg² in big, <1% in tiny"
    with pytest.raises(ValueError, match="one sum per name"):
        top_shares(["a"], [1.0, 2.0])


@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=8), st.floats(0, 1e12, allow_nan=False)),
        min_size=1,
        max_size=40,
        unique_by=lambda pair: pair[0],
    ),
    st.integers(1, 10),
)
def test_top_shares_sum_to_at_most_one_sorted_and_each_the_parameters_part(
    pairs: list[tuple[str, float]], most: int
) -> None:
    names, sums = [p[0] for p in pairs], [p[1] for p in pairs]
    shares = top_shares(names, sums, most)
    total = math.fsum(sums)
    if total == 0:
        assert shares == ()
        return
    assert len(shares) == min(most, len(names))
    assert sum(share for _, share in shares) <= 1 + 1e-9
    assert [share for _, share in shares] == sorted((share for _, share in shares), reverse=True)
    by_name = dict(pairs)
    for name, share in shares:
        assert share == pytest.approx(by_name[name] / total)
    left_out = set(names) - {name for name, _ in shares}
    assert all(by_name[name] / total <= shares[-1][1] + 1e-12 for name in left_out)
