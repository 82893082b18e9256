"""Worker code for what the guard says of a mistake: hand-written clips the guard does not see, a
max_norm other than the declared one, clip calls named by their line in the training code."""

from __future__ import annotations

import warnings

import torch
from guard_workers import GuardLog, _wrapped, found
from models import MAX_NORM, batch, loss_of, rows

import gradaudit


def clip_shards_by_hand(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The FSDP2 mistake written out: each rank scales its own shards by its own local norm."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


def train(
    rank: int, world_size: int, out_dir: str, stack: str, mistake: str, steps: int = 4, **options
) -> dict:
    model = _wrapped(stack, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        guard = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=out_dir, **options)
        for step in range(1, steps + 1):
            opt.zero_grad()
            loss_of(model(x * step), y).backward()
            if mistake == "unseen_local_clip" and step in (2, 3):
                clip_shards_by_hand(model, MAX_NORM)
            elif mistake == "inf_on_rank_1" and step == 2:
                if rank == 1:
                    grad = model.fc2.weight.grad
                    (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            elif mistake == "half_max_norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM / 2)
            elif mistake == "three_clips" and step == 2:
                for _ in range(3):
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        guard.remove()
    return found(guard, caught, log)
