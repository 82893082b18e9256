"""GA701 in stats mode: the update norm of the parameters kept with values (full_params=)."""

from __future__ import annotations

import torch
from builders import box, check, clip, write_step


def test_update_norm_is_reported_over_the_pieces_dumped_with_parameter_values(tmp_path):
    g = torch.ones(2, 3, dtype=torch.float64)
    before = torch.zeros(2, 3, dtype=torch.float64)
    pieces = {
        0: [box("w", (0, 0), grad=g, param_before=before, param_after=before - 0.1 * g)],
        1: [box("w", (2, 0), grad=g, stats_only=True)],
    }
    write_step(
        tmp_path, world_size=2, params={"w": (4, 3)}, pieces=pieces, clips=clip(10.0, reported_norm=12**0.5)
    )
    ga701 = next(f for f in check(tmp_path).findings if f.code == "GA701")
    assert ga701.evidence["num_pieces"] == 1 and ga701.evidence["num_pieces_in_step"] == 2
    assert abs(ga701.evidence["update_norm"] - 0.1 * 6**0.5) < 1e-12
    assert ga701.message.startswith("over the 1 of 2 pieces dumped with parameter values")
