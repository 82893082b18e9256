"""Worker code: one stats-only step of an FSDP2 model on gloo ranks, every rank writing at once."""

from __future__ import annotations

import os

import torch
from models import batch, rows, tiny_net
from scenarios_dtensor import _step


def fsdp2_stats_only(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    model = tiny_net()
    for module in (model.fc1, model.fc2, model.norm, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _step(
        model, os.path.join(out_root, "fsdp2_stats_only"), x, y, torch.nn.utils.clip_grad_norm_, mode="stats"
    )
