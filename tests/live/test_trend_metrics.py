"""TrendLine.metrics: what the framework integrations log for a checked step."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradaudit.live.trend import TrendLine


def line(**changes) -> TrendLine:
    base = {
        "step": 7,
        "true_norm": 4.0,
        "reported_norm": 4.0,
        "expected_coef": 0.25,
        "min_coef": 0.25,
        "max_coef": 0.25,
    }
    return TrendLine(**{**base, **changes})


def test_a_right_step_logs_anomaly_0_its_true_norm_and_ratio_1():
    assert line().metrics() == {
        "gradaudit/anomaly": 0.0,
        "gradaudit/true_norm": 4.0,
        "gradaudit/reported_over_true": 1.0,
    }
    assert set(line().metrics(prefix="gradaudit_")) == {
        "gradaudit_anomaly",
        "gradaudit_true_norm",
        "gradaudit_reported_over_true",
    }


def test_the_anomaly_is_the_number_of_the_steps_error_codes_and_a_local_norm_shows_in_the_ratio():
    values = line(reported_norm=1.0, codes=("GA201", "GA301", "GA302")).metrics()
    assert values["gradaudit/anomaly"] == 3.0 and values["gradaudit/reported_over_true"] == 0.25


def test_a_step_clipped_three_times_logs_its_last_calls_norm_over_the_true_norm_not_the_first_calls():
    thrice = line(clip_calls=3, last_reported_norm=1.0, codes=("GA501",))
    assert thrice.reported_norm == thrice.true_norm  # the first call's pair, as the warning gives it
    assert thrice.metrics()["gradaudit/reported_over_true"] == 0.25
    assert thrice.metrics()["gradaudit/anomaly"] == 1.0
    # read back from the trend file, which keeps the first call's pair only: that pair's ratio
    assert line(clip_calls=3, codes=("GA501",)).metrics()["gradaudit/reported_over_true"] == 1.0


def test_the_frameworks_own_grad_norm_replaces_the_reported_norm():
    assert line(clip_calls=3, last_reported_norm=1.0).metrics(reported_norm=2.0)[
        "gradaudit/reported_over_true"
    ] == pytest.approx(0.5)


@pytest.mark.parametrize("true_norm", [math.nan, math.inf, None])
def test_a_step_without_a_finite_true_norm_still_logs_its_anomaly(true_norm):
    assert line(true_norm=true_norm, codes=("GA101",)).metrics() == {"gradaudit/anomaly": 1.0}


def test_a_step_the_scaler_skipped_logs_nothing():
    assert line(true_norm=None, skipped=True).metrics() == {}


_numbers = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=300, deadline=None)
@given(
    step=st.integers(min_value=0, max_value=10**12),
    true_norm=_numbers,
    reported_norm=_numbers,
    expected_coef=_numbers,
    min_coef=_numbers,
    max_coef=_numbers,
    codes=st.lists(st.sampled_from(["GA201", "GA301", "GA502"]), max_size=2).map(tuple),
    skipped=st.booleans(),
    clip_calls=st.integers(min_value=1, max_value=3),
    spike=st.booleans(),
)
def test_a_trend_lines_text_is_its_json_with_sorted_keys(**fields):
    import json

    trend = TrendLine(**fields)
    assert trend.to_text() == json.dumps(trend.to_json(), sort_keys=True)
    assert json.loads(trend.to_text())["step"] == fields["step"]
