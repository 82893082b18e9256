"""Ranks whose files record equal topologies share one Topology object after loading (each rank's
file lists the groups of every rank); ranks recording different ones keep their own."""

from __future__ import annotations

import torch
from builders import FIXED

from gradaudit.capture.build import whole, write_rank
from gradaudit.dumpfile import load_step
from gradaudit.model import ClipRecord, Topology


def _write(directory, topologies):
    for rank, topology in enumerate(topologies):
        write_rank(
            directory,
            rank=rank,
            world_size=len(topologies),
            step=1,
            params={"w": (4,)},
            pieces=[whole("w", grad=torch.ones(4), replica_group="dp", stats_only=True)],
            clip=ClipRecord(max_norm=1.0, reported_norm=2.0),
            topology=topology,
            **FIXED,
        )


def test_equal_topologies_of_all_ranks_are_one_object_after_loading(tmp_path):
    groups = {"dp": ((0, 1, 2, 3),), "pairs": ((0, 1), (2, 3))}
    _write(tmp_path / "step_1", [Topology(groups=groups) for _ in range(4)])
    step = load_step(tmp_path / "step_1")
    topologies = [step.ranks[r].topology for r in step.ranks_present]
    assert all(t is topologies[0] for t in topologies)
    assert topologies[0] == Topology(groups=groups)


def test_ranks_recording_different_topologies_keep_each_their_own(tmp_path):
    first = Topology(groups={"dp": ((0, 1, 2, 3),)})
    second = Topology(groups={"dp": ((0, 1, 2, 3),)}, norm_group="dp")
    _write(tmp_path / "step_1", [first, second, first, second])
    step = load_step(tmp_path / "step_1")
    loaded = [step.ranks[r].topology for r in step.ranks_present]
    assert loaded == [first, second, first, second]
    assert loaded[0] is loaded[2] and loaded[1] is loaded[3] and loaded[0] is not loaded[1]
