"""GA302 with drifted replicas (GA601): a rank may rightly have used the step's true norm or the one its
own copies give; the message states the numbers it compared."""

from __future__ import annotations

import torch
from builders import check, clip, codes, whole, write_step

from gradaudit.norms import expected_clip_coef


def _drifted(directory, coef_of_rank_1: float, reported_1: float):
    g0 = torch.tensor([3.0, 4.0], dtype=torch.float64)
    g1 = torch.tensor([3.0, 4.5], dtype=torch.float64)  # rank 1's copy drifted
    coef_0 = expected_clip_coef(5.0, 1.0)
    write_step(
        directory,
        world_size=2,
        params={"w": (2,)},
        pieces={
            0: [whole("w", grad=g0, grad_clipped=g0 * coef_0)],
            1: [whole("w", grad=g1, grad_clipped=g1 * coef_of_rank_1)],
        },
        clips={0: clip(1.0, reported_norm=5.0), 1: clip(1.0, reported_norm=reported_1)},
    )


def test_a_drifted_rank_that_clipped_by_the_steps_true_norm_is_not_called_unexplained_or_wrong(tmp_path):
    _drifted(tmp_path, expected_clip_coef(5.0, 1.0), 5.0)
    report = check(tmp_path)
    assert "GA601" in codes(report) and not codes(report) & {"GA204", "GA302"}
    assert {row.diagnosis for row in report.ranks} == {"correct"}


def test_ga302_with_a_drifted_rank_states_both_coefficients_it_compared(tmp_path):
    _drifted(tmp_path, 0.5, 2.0)
    report = check(tmp_path)
    ga302 = next(f for f in report.findings if f.code == "GA302")
    own = expected_clip_coef(float(torch.tensor([3.0, 4.5]).norm()), 1.0)
    assert ga302.ranks == (1,)
    assert "applied 0.5" in ga302.message and f"{own:.6g}" in ga302.message and "0.2" in ga302.message
