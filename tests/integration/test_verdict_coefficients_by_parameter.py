"""Coefficients that differ by parameter, not by rank, on 2 FSDP2 gloo ranks: each
parameter received one coefficient on every rank, so GA301's per-rank coefficients (each rank's mean
over parameters that received different ones) were numbers no parameter received. The norms those
clip lists give are named too (GA210, where they were GA204)."""

from __future__ import annotations

import math

import coefper_workers
import pytest
from launcher import run_ranks
from reassemble import audit_report

pytestmark = pytest.mark.integration

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("coefficients_by_parameter")
    results = run_ranks(coefper_workers.all_coefficient_cases, WORLD_SIZE, (str(out_root),), timeout_s=180)
    return out_root, results


def _report(runs, scenario):
    out_root, results = runs
    return audit_report(out_root / scenario / "step_1"), [r[scenario] for r in results]


@pytest.mark.parametrize(
    ("scenario", "measured_from"), [("tied_twice", "values"), ("tied_twice_stats", "sums of squares")]
)
def test_a_tied_weight_listed_twice_in_the_clip_list_is_named_with_the_square_of_the_coefficient(
    runs, scenario, measured_from
):
    report, per_rank = _report(runs, scenario)
    coef = per_rank[0]["coef"]  # max_norm / (the norm that counts the tied weight twice + eps)
    [found] = [f for f in report.findings if f.code == "GA304"]
    assert found.severity.value == "error" and found.params == ("embed.weight",) and found.ranks == (0, 1)
    assert found.evidence["cause"] == "listed_twice" and found.evidence["power"] == 2
    assert found.evidence["measured_from"] == measured_from
    assert math.isclose(found.evidence["others_clip_coef"], coef, rel_tol=1e-4)
    assert math.isclose(found.evidence["clip_coef"], coef**2, rel_tol=1e-4)
    assert math.isclose(found.evidence["expected_clip_coef"], report.expected_clip_coef, rel_tol=1e-9)
    assert f"{per_rank[0]['reported']:.6g}" in found.message  # the clip norm: the tied weight counted twice
    assert "GA301" not in {f.code for f in report.findings}  # the ranks agree on every parameter
    assert "GA302" in {n.code for n in report.not_checked}
    assert report.verdict.endswith(
        "GA304: parameters received different clip coefficients on ranks 0-1 (and 1 more finding)."
    )


@pytest.mark.parametrize(
    ("scenario", "measured_from"), [("per_group", "values"), ("per_group_stats", "sums of squares")]
)
def test_the_split_clip_api_called_once_per_param_group_is_named_with_each_groups_coefficient(
    runs, scenario, measured_from
):
    report, per_rank = _report(runs, scenario)
    first, second = per_rank[0]["coefs"]  # what each call's own norm gave its own group
    assert first == 1.0 and second < 1.0
    found = {f.params: f for f in report.findings if f.code == "GA304"}
    assert set(found) == {
        ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"),
        ("head.bias", "head.weight", "norm.bias", "norm.weight"),
    }
    unscaled, scaled = (
        found[("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight")],
        found[("head.bias", "head.weight", "norm.bias", "norm.weight")],
    )
    assert unscaled.evidence["clip_coef"] == 1.0 and "clip_calls" not in unscaled.evidence
    assert (
        math.isclose(scaled.evidence["clip_coef"], second, rel_tol=1e-5)
        and scaled.evidence["clip_calls"] == "2"
    )
    [expected] = {f.evidence["expected_clip_coef"] for f in found.values()}
    true_norm = per_rank[0]["true_norm"]
    assert math.isclose(expected, coefper_workers.GROUP_MAX_NORM / (true_norm + 1e-6), rel_tol=1e-5)
    assert all(
        f.evidence["cause"] == "per_call" and f.evidence["measured_from"] == measured_from
        for f in found.values()
    )
    assert "once per optimizer param group" in scaled.message
    assert "GA301" not in {f.code for f in report.findings}
    assert "GA304" in report.verdict
    [ga501] = [f for f in report.findings if f.code == "GA501"]
    assert "one call per param group" in ga501.message and "microbatch" not in ga501.message


def _codes(report) -> set[str]:
    return {f.code for f in report.findings}


@pytest.mark.parametrize("scenario", ["tied_twice", "tied_twice_stats", "tied_head_added"])
def test_the_norm_of_a_clip_list_holding_a_tied_weight_twice_names_that_parameter_not_an_unexplained_norm(
    runs, scenario
):
    report, per_rank = _report(runs, scenario)
    reported, tied_norm = per_rank[0]["reported"], per_rank[0]["tied_norm"]
    # what the hypothesis states: the true norm with the tied weight's squares counted twice
    assert math.isclose(reported**2, report.global_norm**2 + tied_norm**2, rel_tol=1e-5)
    assert "GA204" not in _codes(report) and "GA304" in _codes(report)
    [found] = [f for f in report.findings if f.code == "GA210"]
    assert found.ranks == (0, 1) and found.params == ("embed.weight",)
    assert found.evidence["cause"] == "listed_twice" and found.evidence["param"] == "embed.weight"
    assert math.isclose(found.evidence["matched_norm"], reported, rel_tol=1e-5)
    assert "counts parameter 'embed.weight' twice" in found.message
    assert found.fix.startswith("List each parameter once")
    assert {row.diagnosis for row in report.ranks} == {"listed_twice:embed.weight"}


@pytest.mark.parametrize("scenario", ["per_group", "per_group_stats"])
def test_param_groups_clipped_each_by_its_own_norm_are_named_as_clipped_separately_not_an_unexplained_norm(
    runs, scenario
):
    report, per_rank = _report(runs, scenario)
    first, second = per_rank[0]["norms"]  # each call's norm of its own param group
    assert math.isclose(first**2 + second**2, per_rank[0]["true_norm"] ** 2, rel_tol=1e-5)
    assert "GA204" not in _codes(report) and "GA304" in _codes(report)
    [found] = [f for f in report.findings if f.code == "GA210"]
    assert found.ranks == (0, 1) and found.evidence["cause"] == "per_call"
    assert found.evidence["num_clip_calls"] == 2
    assert math.isclose(found.evidence["matched_norm"], second, rel_tol=1e-5)
    assert "one clip call per optimizer param group" in found.message and f"{first:.6g}" in found.message
    assert found.fix.startswith("Clip once per step")
    assert {row.diagnosis for row in report.ranks} == {"per_param_group"}
