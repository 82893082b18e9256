"""Rank workers for Accelerate loops with gradient accumulation (2 micro-batches per optimizer step)."""

from __future__ import annotations

import os

import torch
from models import MAX_NORM, batch, loss_of, rows, tiny_net

NUM_MICROBATCHES = 2
NUM_STEPS = 2


def accelerate_runs(rank: int, world_size: int, out_root: str) -> dict:
    from accelerate import Accelerator

    from gradaudit.integrations.accelerate import AccelerateAudit

    results = {}
    for name, guarded in (("accelerate_ok", True), ("accelerate_clip_every_microbatch", False)):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=NUM_MICROBATCHES)
        model = tiny_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        audit = AccelerateAudit(
            accelerator, model, optimizer, os.path.join(out_root, name), steps=[2], strict=True
        )
        x, y = batch()
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        norms = []
        for _ in range(NUM_STEPS):
            for i in range(NUM_MICROBATCHES):
                with accelerator.accumulate(model):
                    xs, ys = rows(x, i, NUM_MICROBATCHES), rows(y, i, NUM_MICROBATCHES)
                    accelerator.backward(loss_of(model(xs), ys))
                    if accelerator.sync_gradients or not guarded:
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                    optimizer.step()
                    optimizer.zero_grad()
        audit.remove()
        results[name] = {"norms": norms, "paths": [str(p) for p in audit.paths]}
        accelerator.free_memory()
    return results
