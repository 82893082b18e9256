"""GA401-GA402: nonfinite gradient values and ranks that disagree on skipping."""

import math

import torch
from builders import check, clip, codes, finding, not_checked, sharded_rows, tensor_with_norm


def _grads():
    return [tensor_with_norm(0.8, (2, 3), seed=r, dtype=torch.float32) for r in range(4)]


def test_a_nonfinite_shard_on_one_rank_names_that_rank_and_parameter(tmp_path):
    grads = _grads()
    grads[2][0, 1] = math.inf
    grads[2][1, 2] = math.nan
    sharded_rows(tmp_path, grads, clips=clip(1.0, reported_norm=math.nan), param="layers.0.w")
    report = check(tmp_path)
    found = finding(report, "GA401")
    assert found.ranks == (2,) and found.params == ("layers.0.w",)
    assert (found.evidence["num_nan"], found.evidence["num_posinf"], found.evidence["num_neginf"]) == (
        1,
        1,
        0,
    )
    assert "rank 2" in found.message
    assert report.ranks[2].nonfinite.total == 2 and report.ranks[0].nonfinite.total == 0
    assert math.isnan(report.global_norm)
    assert "GA302" in not_checked(report)


def test_finite_gradients_raise_no_nonfinite_finding(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=clip(1.0))
    assert "GA401" not in codes(check(tmp_path))


def test_a_finite_fp32_value_near_1e20_does_not_overflow_the_norm(tmp_path):
    grads = _grads()
    grads[0][0, 0] = 1e20
    sharded_rows(tmp_path, grads, clips=clip(1.0))
    report = check(tmp_path)
    assert "GA401" not in codes(report)
    assert math.isfinite(report.global_norm) and abs(report.global_norm / 1e20 - 1) < 1e-6


def test_ranks_that_disagree_on_skipping_the_step_are_reported(tmp_path):
    clips = {r: clip(1.0, found_inf=(r == 1), step_skipped=(r == 1)) for r in range(4)}
    sharded_rows(tmp_path, _grads(), clips=clips)
    report = check(tmp_path)
    found = [f for f in report.findings if f.code == "GA402"]
    assert len(found) == 2 and all(f.ranks == (1,) for f in found)


def test_ranks_that_all_skip_together_raise_no_disagreement(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=clip(1.0, found_inf=True, step_skipped=True))
    assert "GA402" not in codes(check(tmp_path))


def test_skip_agreement_is_not_checked_when_nobody_recorded_it(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=clip(1.0))
    assert "GA402" in not_checked(check(tmp_path))


def test_a_nan_coefficient_applied_to_the_gradients_is_measured_as_nan_not_zero(tmp_path):
    grads = _grads()
    grads[1][0, 0] = math.nan
    clipped = [torch.full_like(g, math.nan) for g in grads]
    sharded_rows(tmp_path, grads, clips=clip(1.0), clipped=clipped)
    report = check(tmp_path)
    assert all(math.isnan(row.applied_clip_coef) for row in report.ranks)
    assert {row.applied_coef_source for row in report.ranks} == {"gradients"}
    assert "GA301" not in codes(report) and "GA301" in not_checked(report)
