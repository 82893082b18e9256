"""Worker code for the guard's spike= rule: TinyNet under DDP or FSDP2 on gloo ranks, clipped
correctly, one batch's targets scaled by 100 at SPIKE_STEP (its inputs would not do: TinyNet's
LayerNorm undoes their scale); each rank also computes, right after that step's
backward, every parameter's Σg² from the full gradients (DTensor.full_tensor()): the unsharded numbers
the guard's shares must match."""

from __future__ import annotations

import warnings

import torch
from guard_workers import GuardLog, _wrapped, found
from models import MAX_NORM, batch, loss_of, rows

import gradaudit

NUM_STEPS = 14
SPIKE_STEP = 11


def train(rank: int, world_size: int, out_dir: str, stack: str) -> dict:
    model = _wrapped(stack, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    unsharded = {}
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        guard = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=out_dir, spike=10.0)
        for step in range(1, NUM_STEPS + 1):
            opt.zero_grad()
            loss_of(model(x), y * (100.0 if step == SPIKE_STEP else 1.0)).backward()
            if step == SPIKE_STEP:
                for name, param in model.named_parameters():
                    grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                    unsharded[name.removeprefix("module.")] = float(grad.double().square().sum())
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        guard.remove()
    return {**found(guard, caught, log), "unsharded": unsharded}
