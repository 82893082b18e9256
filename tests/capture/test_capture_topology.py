"""Pure pieces of the capture: mesh rank lists, user groups, norm group naming, local index runs."""

from __future__ import annotations

import pytest

from gradaudit.capture.dtensor import _runs_of
from gradaudit.capture.topology import (
    TopologyBuilder,
    normalize_groups,
    rank_lists_over_axes,
    with_norm_group,
)
from gradaudit.errors import CaptureError
from gradaudit.model import Topology


def test_rank_lists_of_each_axis_of_a_2d_mesh():
    ranks = (0, 1, 2, 3, 4, 5)  # mesh [[0, 1, 2], [3, 4, 5]] of shape (2, 3)
    assert rank_lists_over_axes(ranks, (2, 3), [0]) == ((0, 3), (1, 4), (2, 5))
    assert rank_lists_over_axes(ranks, (2, 3), [1]) == ((0, 1, 2), (3, 4, 5))
    assert rank_lists_over_axes(ranks, (2, 3), [0, 1]) == ((0, 1, 2, 3, 4, 5),)


def test_rank_lists_follow_a_permuted_mesh():
    assert rank_lists_over_axes((3, 1, 2, 0), (2, 2), [1]) == ((0, 2), (1, 3))


def test_user_groups_accept_one_rank_list_or_several():
    groups = normalize_groups({"tp": [0, 1], "dp": [[0, 2], [1, 3]]}, world_size=4)
    assert groups == {"tp": ((0, 1),), "dp": ((0, 2), (1, 3))}


@pytest.mark.parametrize("bad", [{"tp": [0, 9]}, {"tp": "0,1"}, {"": [0]}, {"tp": [[0], "1"]}])
def test_user_groups_that_are_not_rank_lists_inside_the_world_raise(bad):
    with pytest.raises(CaptureError):
        normalize_groups(bad, world_size=4)


def test_builder_names_an_existing_group_before_world_and_adds_unknown_ones():
    builder = TopologyBuilder(rank=1, world_size=4)
    builder.add_group("dp", [(0, 1), (2, 3)])
    assert builder.name_of((0, 1), default="ddp") == "dp"
    assert builder.name_of((0, 1, 2, 3), default="ddp") == "world"
    assert builder.name_of((1, 3), default="ddp") == "ddp"
    assert builder.build().groups["ddp"] == ((1, 3),)


def test_norm_group_names_the_matching_axis_or_adds_the_mesh_group():
    topology = Topology(groups={"world": ((0, 1, 2, 3),), "dp_shard": ((0, 1), (2, 3))})
    assert with_norm_group(topology, (2, 3), rank=2, default="x").norm_group == "dp_shard"
    assert with_norm_group(topology, (0, 1, 2, 3), rank=2, default="x").norm_group == "world"
    added = with_norm_group(topology, (1, 3), rank=1, default="dp_replicate")
    assert added.norm_group == "dp_replicate" and added.groups["dp_replicate"] == ((1, 3),)


def test_local_indices_become_contiguous_runs():
    assert _runs_of([4, 5, 6, 7]) == [(4, 8)]
    assert _runs_of([0, 1, 4, 5, 9]) == [(0, 2), (4, 6), (9, 10)]
    assert _runs_of([]) == []


class _FakeMesh:
    """What dtensor_pieces reads of a DeviceMesh, for one rank of a 1-D mesh of 2 ranks."""

    def __init__(self, coordinate: int) -> None:
        import torch

        self.mesh = torch.tensor([0, 1])
        self.mesh_dim_names = ("dp_shard",)
        self.ndim = 1
        self._coordinate = coordinate

    def get_coordinate(self):
        return [self._coordinate]

    def size(self, dim: int) -> int:
        return 2

    def _get_root_mesh(self):
        return self


class _FakeDTensorParam:
    def __init__(self, mesh, placements, global_value, local_value) -> None:
        self.device_mesh, self.placements = mesh, placements
        self.shape, self.dtype = global_value.shape, global_value.dtype
        self._local = local_value
        self.grad = local_value * 10

    def to_local(self):
        return self._local


def test_a_non_contiguous_strided_shard_becomes_one_piece_per_run():
    import torch
    from torch.distributed.tensor.placement_types import _StridedShard

    from gradaudit.capture.dtensor import dtensor_pieces

    global_value = torch.arange(24.0).reshape(8, 3)
    local = global_value[[2, 3, 6, 7]]  # what _StridedShard(0, split_factor=2) leaves on coordinate 1
    param = _FakeDTensorParam(_FakeMesh(1), (_StridedShard(0, split_factor=2),), global_value, local)
    pieces = dtensor_pieces("w", None, param, TopologyBuilder(rank=1, world_size=2))
    assert [(p.regions[0].offsets, p.regions[0].shape) for p in pieces] == [
        ((2, 0), (2, 3)),
        ((6, 0), (2, 3)),
    ]
    for piece in pieces:
        (box,) = piece.regions
        rows = slice(box.offsets[0], box.offsets[0] + box.shape[0])
        assert torch.equal(piece.value(), global_value[rows])
        assert torch.equal(piece.grad(), global_value[rows] * 10)
    assert all(p.replica_group is None for p in pieces)
