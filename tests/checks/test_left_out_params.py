"""A parameter one rank left out of its dump is "not checked" (GA104) on every rank: never an
ownership gap (GA103) for the part the other ranks hold, nor a true norm that counts only that part."""

from __future__ import annotations

import dataclasses
import math

from builders import box, check, clip, tensor_with_norm, write_step

from gradaudit.dumpfile import load_step
from gradaudit.dumpfile.writer import write_rank_file
from gradaudit.model import NotCapturedParam


def test_a_parameter_one_rank_left_out_is_not_checked_instead_of_an_ownership_gap(tmp_path):
    a = tensor_with_norm(3.0, (2, 4), seed=1)
    bias = tensor_with_norm(12.0, (4,), seed=3)
    shared = {"world_size": 2, "params": {"w": (4, 4), "b": (4,)}, "clips": clip(100.0, reported_norm=13.0)}
    step_dir = write_step(
        tmp_path / "step_1", pieces={0: [box("w", (0, 0), grad=a), box("b", (0,), grad=bias)]}, **shared
    )
    # rank 1 could not read its shard of w: its file holds b only and lists w as not captured
    write_step(tmp_path / "rank_1", pieces={1: [box("b", (0,), grad=bias)]}, **shared)
    rank1 = load_step(tmp_path / "rank_1").ranks[1]
    left_out = (NotCapturedParam(name="w", reason="its grad could not be read: device lost"),)
    tensors = {(0, "grad"): bias}
    write_rank_file(step_dir, dataclasses.replace(rank1, not_captured=left_out), tensors)

    report = check(step_dir)

    assert "GA103" not in {f.code for f in report.findings}
    assert math.isclose(report.global_norm, float(bias.double().norm()), rel_tol=1e-6)  # w is in no norm
    [ga104] = [n for n in report.not_checked if n.code == "GA104"]
    assert "w on rank 1: its grad could not be read: device lost" in ga104.reason
