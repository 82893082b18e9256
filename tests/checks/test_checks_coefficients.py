"""GA301-GA303: one coefficient for all ranks, the one the true norm asks for, and a bounded result."""

import torch
from builders import check, clip, codes, finding, not_checked, sharded_rows, tensor_with_norm


def _grads():
    return [tensor_with_norm(1.0, (2, 2), seed=r, dtype=torch.float64) for r in range(2)]


def test_ranks_applying_different_coefficients_are_named(tmp_path):
    sharded_rows(tmp_path, _grads(), clips={0: clip(1.0, clip_coef=0.5), 1: clip(1.0, clip_coef=0.7071)})
    found = finding(check(tmp_path), "GA301")
    assert found.evidence["num_distinct"] == 2
    assert "0.5" in found.message and "0.7071" in found.message


def test_coefficients_equal_within_rounding_are_one_coefficient(tmp_path):
    sharded_rows(
        tmp_path, _grads(), clips={0: clip(1.0, clip_coef=0.70710678), 1: clip(1.0, clip_coef=0.70710679)}
    )
    assert "GA301" not in codes(check(tmp_path))


def test_a_single_rank_cannot_disagree_and_says_so(tmp_path):
    sharded_rows(tmp_path, _grads()[:1], clips=clip(1.0, clip_coef=1.0))
    assert "GA301" in not_checked(check(tmp_path))


def test_coefficient_measured_from_gradients_is_compared_with_the_expected_one(tmp_path):
    grads = _grads()  # true norm sqrt(2): expected coefficient 1/sqrt(2)
    sharded_rows(tmp_path, grads, clips=clip(1.0), clipped=[g * 0.9 for g in grads])
    report = check(tmp_path)
    found = finding(report, "GA302")
    assert abs(found.evidence["applied_clip_coef"] - 0.9) < 1e-12
    assert abs(found.evidence["expected_clip_coef"] - 2**-0.5) < 1e-6
    assert report.ranks[0].applied_coef_source == "gradients"


def test_the_expected_coefficient_applied_everywhere_raises_nothing(tmp_path):
    grads = _grads()
    coef = 1.0 / (2**0.5 + 1e-6)
    sharded_rows(tmp_path, grads, clips=clip(1.0), clipped=[g * coef for g in grads])
    report = check(tmp_path)
    assert {"GA301", "GA302", "GA303"} & codes(report) == set()


def test_a_post_clip_norm_above_max_norm_is_reported(tmp_path):
    grads = _grads()
    sharded_rows(tmp_path, grads, clips=clip(1.0), clipped=[g.clone() for g in grads])
    found = finding(check(tmp_path), "GA303")
    assert abs(found.evidence["post_clip_norm"] - 2**0.5) < 1e-9


def test_post_clip_norm_is_not_checked_without_clipped_gradients(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=clip(1.0, clip_coef=0.7))
    report = check(tmp_path)
    assert "GA303" in not_checked(report) and "GA303" not in codes(report)
