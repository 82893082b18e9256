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


def _fp16_accelerator(init_scale: float, **kwargs):
    """A real Accelerator with mixed_precision="fp16" and a real CPU GradScaler. Accelerate creates its
    scaler only off CPU (accelerator.py: `self.state.mixed_precision == "fp16" and self.device.type !=
    "cpu"`), so the one it would create is installed by hand, before prepare() hands it to the
    AcceleratedOptimizer; everything after (backward scaling, unscale in clip_grad_norm_, scaler.step
    and update) is Accelerate's and torch's own code."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="fp16", **kwargs)
    accelerator.native_amp = True
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return accelerator


def accelerate_fp16_runs(rank: int, world_size: int, out_root: str) -> dict:
    """fp16 with a GradScaler: AccelerateAudit around accelerator.clip_grad_norm_ (correct), and the
    mistake of clipping with torch.nn.utils.clip_grad_norm_, which skips Accelerate's unscale."""
    import gradaudit
    from gradaudit.integrations.accelerate import AccelerateAudit

    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    results = {}
    for name in ("accelerate_fp16_ok", "accelerate_fp16_torch_clip"):
        accelerator = _fp16_accelerator(init_scale=2.0**12)
        model = tiny_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        out_dir = os.path.join(out_root, name)
        if name == "accelerate_fp16_ok":
            audit = AccelerateAudit(accelerator, model, optimizer, out_dir, steps=[1], strict=True)
            accelerator.backward(loss_of(model(x), y))
            norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            audit.remove()
            paths = [str(p) for p in audit.paths]
        else:
            with gradaudit.audit_step(
                model,
                out_dir,
                step=1,
                max_norm=MAX_NORM,
                optimizer=optimizer,
                scaler=accelerator.scaler,
                strict=True,
            ) as session:
                accelerator.backward(loss_of(model(x), y))
                norm = session.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
                optimizer.step()
            paths = [str(session.path)]
        results[name] = {"norm": float(norm), "paths": paths, "scale": float(accelerator.scaler.get_scale())}
        accelerator.free_memory()
    return results
