"""Blind spots of the diagnosis on 2 gloo ranks: steps whose verdict used to be wrong although the
numbers were all there."""

from __future__ import annotations

import math

import blindspot_workers
import pytest
from launcher import run_ranks
from reassemble import audit_report

pytestmark = pytest.mark.integration

WORLD_SIZE = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("blind_spots")
    results = run_ranks(blindspot_workers.all_blind_spots, WORLD_SIZE, (str(out_root),), timeout_s=180)
    return out_root, results


def _report(runs, scenario):
    out_root, results = runs
    return audit_report(out_root / scenario / "step_1"), [r[scenario] for r in results]


@pytest.mark.parametrize("scenario", ["sp_ok", "sp_ok_stats"])
def test_a_correct_sequence_parallel_step_is_clean_and_its_norm_is_torchs(runs, scenario):
    report, per_rank = _report(runs, scenario)
    assert all(r["norm_grad"] == "(Partial(sum),)" for r in per_rank)  # what the step is about
    returned = per_rank[0]["returned_norm"]
    assert math.isclose(returned, blindspot_workers.single_process_sequence_norm(), rel_tol=1e-5)
    assert math.isclose(report.global_norm, returned, rel_tol=1e-5)
    assert [f.code for f in report.findings if f.severity.value != "info"] == []
    assert "Clipping used the true global norm" in report.verdict


@pytest.mark.parametrize("scenario", ["unrecorded_clip", "unrecorded_clip_stats"])
def test_gradients_clipped_before_the_recorded_call_are_an_error_not_a_pass(runs, scenario):
    report, per_rank = _report(runs, scenario)
    assert per_rank[0]["first_norm"] > 2 * blindspot_workers.DDP_MAX_NORM  # the hand clip did clip
    assert "GA504" in {f.code for f in report.findings if f.severity.value == "error"}
    assert "GA504" in report.verdict and "clipped before the recorded clip call" in report.verdict
    assert math.isclose(report.global_norm, blindspot_workers.DDP_MAX_NORM, rel_tol=1e-5)


@pytest.mark.parametrize("scenario", ["no_clip", "no_clip_stats"])
def test_no_clip_call_with_max_norm_declared_is_named_with_the_norm_the_step_used(runs, scenario):
    report, per_rank = _report(runs, scenario)
    used = per_rank[0]["used_norm"]
    assert used > blindspot_workers.DDP_MAX_NORM
    assert math.isclose(report.global_norm, used, rel_tol=1e-5)  # was 0: no gradient "before clipping"
    assert report.verdict.startswith(f"True global L2 norm {used:.6g}")
    assert "GA505" in report.verdict and "no clip call although max_norm was declared" in report.verdict
    assert math.isclose(
        report.expected_clip_coef, blindspot_workers.DDP_MAX_NORM / (used + 1e-6), rel_tol=1e-5
    )


@pytest.mark.parametrize("scenario", ["value_clip", "value_clip_stats", "value_clip_via_audit"])
def test_clip_by_value_is_named_as_element_wise_clipping_and_the_norm_checks_are_not_checked(runs, scenario):
    report, _ = _report(runs, scenario)
    assert "GA506" in report.verdict
    [finding] = [f for f in report.findings if f.code == "GA506"]
    assert finding.evidence["clip_value"] == pytest.approx(blindspot_workers.CLIP_VALUE)
    recognised = (
        "the clamp it left" if scenario == "value_clip_via_audit" else "the recorded clip_grad_value_ call"
    )
    assert finding.evidence["recognised"] == recognised
    assert not {"GA204", "GA301", "GA302", "GA303"} & {
        f.code for f in report.findings
    }  # no invented coefficient
    assert {"GA201", "GA302"} <= {n.code for n in report.not_checked}


@pytest.mark.parametrize("scenario", ["every_copy", "every_copy_stats"])
def test_squares_of_full_gradients_all_reduced_again_are_every_copy_counted_not_unexplained(runs, scenario):
    report, per_rank = _report(runs, scenario)
    assert math.isclose(per_rank[0]["reported"], math.sqrt(2) * report.global_norm, rel_tol=1e-5)
    codes = {f.code for f in report.findings}
    assert "GA202" in codes and "GA204" not in codes
    [ga202] = [f for f in report.findings if f.code == "GA202"]
    assert ga202.evidence["group"] in ("world", "dp_shard") and "every copy" in ga202.message


def test_replicas_whose_weights_drifted_in_an_earlier_step_are_named_in_the_next(runs):
    out_root, _ = runs
    first = audit_report(out_root / "weights_drift" / "step_1")
    assert "GA301" in {f.code for f in first.findings}  # the ranks applied different coefficients
    report = audit_report(out_root / "weights_drift" / "step_2")
    [drift] = [f for f in report.findings if f.code == "GA605"]
    assert drift.severity.value == "error" and drift.ranks == (1,)
    assert "GA601" not in {f.code for f in report.findings}  # DDP's all-reduce made the gradients agree
