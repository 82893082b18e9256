"""The next-weights rule through the optimizer: what an update makes of gradient differences within
tolerance is allowed; anything larger is not."""

from __future__ import annotations

import numpy as np

from gradaudit.analysis.updates import judge_elements

LR = 0.1


def _judge(ours_after, grad, after, before):
    return judge_elements(
        param="w",
        ours_after=ours_after,
        ref_before=before,
        ref_after=after,
        ref_grad=grad,
        base_tolerance=1e-8,
        gradient_tolerance=1e-6,
    )


def test_an_sgd_difference_within_lr_times_the_gradient_tolerance_is_explained():
    before, grad = (
        np.zeros(4),
        np.array([1.0, -2.0, 0.5, 3.0]),
    )
    after = before - LR * grad
    judged = _judge(after + 0.5 * LR * 1e-6, grad, after, before)
    assert judged.explained and judged.num_near_zero_gradient == 0


def test_an_sgd_difference_beyond_what_the_gradient_tolerance_allows_is_not_explained():
    before, grad = (
        np.zeros(4),
        np.array([1.0, -2.0, 0.5, 3.0]),
    )
    after = before - LR * grad
    assert not _judge(after + 1e-3, grad, after, before).explained


def test_adam_noise_on_a_near_zero_gradient_is_explained_up_to_the_step_size():
    before = np.zeros(3)
    grad = np.array([1.0, 1e-11, -2.0])
    after = before - LR * np.array([1.0, 0.001, -1.0])  # Adam: about lr per element
    ours = after.copy()
    ours[1] = before[1] + LR * 0.5  # the noise went the other way
    judged = _judge(ours, grad, after, before)
    assert judged.explained and judged.num_near_zero_gradient == 1
    ours[1] = before[1] + 3 * LR  # more than any step could move it
    assert not _judge(ours, grad, after, before).explained
