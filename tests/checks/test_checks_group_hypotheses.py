"""GA207-GA209: norms that get one parameter group wrong, average per-rank norms, or overflow."""

from __future__ import annotations

import math

import torch
from builders import box, check, clip, codes, sharded_rows, tensor_with_norm, whole, write_step

from gradaudit.model import Topology

WORLD = Topology(groups={"world": ((0, 1, 2, 3),)})


def _shards():
    return [tensor_with_norm(0.3 * (r + 1), (2, 3), seed=r, dtype=torch.float64) for r in range(4)]


def _experts_step(directory, reported: float):
    """Dense `w` sharded by rows over 4 ranks; two experts, each replicated on 2 ranks."""
    dense = _shards()
    experts = [tensor_with_norm(0.5 + e, (3,), seed=10 + e, dtype=torch.float64) for e in range(2)]
    pieces = {
        r: [box("w", (2 * r, 0), grad=dense[r]), whole(f"experts.{r % 2}.w", grad=experts[r % 2])]
        for r in range(4)
    }
    write_step(
        directory,
        world_size=4,
        params={"w": (8, 3), "experts.0.w": (3,), "experts.1.w": (3,)},
        pieces=pieces,
        clips=clip(10.0, reported_norm=reported),
        topology=WORLD,
    )
    dense_sq = sum(float(d.square().sum()) for d in dense)
    experts_sq = sum(float(e.square().sum()) for e in experts)
    return dense_sq, experts_sq


def test_experts_left_out_of_the_norm_are_named_with_their_group(tmp_path):
    dense_sq, _ = _experts_step(tmp_path / "probe", 1.0)
    _experts_step(tmp_path / "step", math.sqrt(dense_sq))
    report = check(tmp_path / "step")
    assert "GA207" in codes(report) and "GA204" not in codes(report)
    found = next(f for f in report.findings if f.code == "GA207")
    assert found.evidence["hypothesis"] == "experts:dropped" and "'experts' parameters" in found.message


def test_experts_counted_on_every_replica_when_only_they_have_replicas_is_the_whole_step_double_count(
    tmp_path,
):
    dense_sq, experts_sq = _experts_step(tmp_path / "probe", 1.0)
    _experts_step(tmp_path / "step", math.sqrt(dense_sq + 2 * experts_sq))
    assert {"GA202"} <= codes(check(tmp_path / "step")) and "GA207" not in codes(check(tmp_path / "step"))


def test_a_correct_norm_of_a_step_with_experts_gives_no_group_finding(tmp_path):
    dense_sq, experts_sq = _experts_step(tmp_path / "probe", 1.0)
    _experts_step(tmp_path / "step", math.sqrt(dense_sq + experts_sq))
    assert not codes(check(tmp_path / "step")) & {"GA204", "GA207"}


def test_local_norms_averaged_over_the_world_are_diagnosed_as_averaged(tmp_path):
    shards = _shards()
    mean = sum(float(s.norm()) for s in shards) / 4
    sharded_rows(tmp_path, shards, clips=clip(10.0, reported_norm=mean), topology=WORLD)
    report = check(tmp_path)
    assert "GA208" in codes(report) and "GA204" not in codes(report)
    found = next(f for f in report.findings if f.code == "GA208")
    assert found.evidence["hypothesis"] == "world" and found.ranks == (0, 1, 2, 3)


def test_a_finite_huge_gradient_whose_float32_norm_overflowed_is_diagnosed_as_overflow(tmp_path):
    grads = [torch.tensor([[1e20, 0.0], [1.0, 2.0]]), torch.ones(2, 2)]
    sharded_rows(tmp_path, grads, clips=clip(1.0, reported_norm=math.inf))
    report = check(tmp_path)
    assert "GA209" in codes(report) and not codes(report) & {"GA204", "GA401"}
    found = next(f for f in report.findings if f.code == "GA209")
    assert found.evidence["hypothesis"] == "float32" and "1e+40" in found.message
