"""Rank workers for gradient accumulation with a clip call after every micro-batch."""

from __future__ import annotations

import os

import torch
from models import MAX_NORM, batch, loss_of, rows, tiny_net

import gradaudit

NUM_MICROBATCHES = 2


def fsdp2_clip_per_microbatch(rank: int, world_size: int, out_root: str) -> dict:
    """FSDP2 without gradient sync on the first micro-batch, clipping after each: the first clip sees
    no gradient at all (`.grad` is None until the reduce-scatter), the second the accumulated one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    model = tiny_net()
    for module in (model.fc1, model.fc2, model.norm, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    out_dir = os.path.join(out_root, "fsdp2_clip_per_microbatch")
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        for i in range(NUM_MICROBATCHES):
            model.set_requires_gradient_sync(i == NUM_MICROBATCHES - 1)
            xs, ys = rows(x, i, NUM_MICROBATCHES), rows(y, i, NUM_MICROBATCHES)
            (loss_of(model(xs), ys) / NUM_MICROBATCHES).backward()
            # The mistake: clipping belongs after the loop, once.
            norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
    return {"norms": norms, "path": str(audit.path)}
