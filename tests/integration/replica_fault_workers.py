"""Worker code for the guard's replica checks: 20 steps of TinyNet clipped correctly, one mantissa bit of
one gradient element flipped on one rank at FLIP_STEP, after the stack's reduction (what a faulty device
does to a replica's copy), under DDP, HSDP's replicate dimension and a tensor-parallel-replicated
LayerNorm; or no flip at all."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from guard_workers import GuardLog, found
from models import MAX_NORM, batch, loss_of, rows, tiny_net
from scenarios_dtensor import per_mesh_clip

import gradaudit

NUM_STEPS = 20
FLIP_STEP = 9
BIT = 1 << 22
"""The highest mantissa bit of a float32: the element moves by up to half its value."""


def flip_one_bit(grad: torch.Tensor) -> None:
    """Flip BIT of the first element of `grad` (the local tensor of a DTensor), in place."""
    local = grad._local_tensor if hasattr(grad, "_local_tensor") else grad
    flat = local.detach().view(-1)
    bits = np.array([flat[0].item()], dtype=np.float32).view(np.uint32) ^ np.uint32(BIT)
    flat[0] = float(bits.view(np.float32)[0])


def _model(stack: str, world_size: int):
    """The model, the parameter whose gradient is flipped, and this rank's index into the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_net()
    if stack == "ddp":
        import torch.distributed as dist

        return (
            torch.nn.parallel.DistributedDataParallel(model),
            "module.fc1.weight",
            dist.get_rank(),
            world_size,
        )
    if stack == "hsdp":
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for module in (model.fc1, model.fc2, model.norm, model.head):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, "fc1.weight", mesh.get_local_rank(0), 2
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model, "norm.weight", 0, 1  # every TP rank sees the whole batch; LayerNorm is replicated


WEIGHT_FLIP_STEP = 6
WEIGHTS_EVERY = 4
WRONG_CLIP_STEP = 7
"""Of `wrong_clip`: the step whose clip call leaves the first parameter out (every rank alike)."""


def train(
    rank: int,
    world_size: int,
    out_dir: str,
    stack: str,
    flip_rank: int | None,
    weights: bool = False,
    weights_every: int = WEIGHTS_EVERY,
    wrong_clip: bool = False,
) -> dict:
    """`weights`: flip a bit of the parameter itself after the optimizer step of WEIGHT_FLIP_STEP
    (the guard compares the replicas' weights every `weights_every` steps), not of its gradient;
    `wrong_clip`: at WRONG_CLIP_STEP every rank clips without the first parameter. Returns what the
    guard found, and the flipped parameter's name."""
    model, flipped, index, count = _model(stack, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    x, y = rows(x, index, count), rows(y, index, count)
    params = dict(model.named_parameters())
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        guard = gradaudit.guard(
            model, max_norm=MAX_NORM, optimizer=opt, out_dir=out_dir, weights_every=weights_every
        )
        for step in range(1, NUM_STEPS + 1):
            opt.zero_grad()
            loss_of(model(x * (1 + step / 10)), y).backward()
            if step == FLIP_STEP and rank == flip_rank and not weights:
                flip_one_bit(params[flipped].grad)
            if stack == "tp":  # DTensor and plain gradients: each mesh's norm, then one total
                guard.clip(per_mesh_clip, list(model.parameters()), MAX_NORM)
            elif wrong_clip and step == WRONG_CLIP_STEP:
                torch.nn.utils.clip_grad_norm_(list(model.parameters())[1:], MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            if step == WEIGHT_FLIP_STEP and rank == flip_rank and weights:
                with torch.no_grad():
                    flip_one_bit(params[flipped])
        guard.remove()
    return {**found(guard, caught, log), "flipped": flipped}
