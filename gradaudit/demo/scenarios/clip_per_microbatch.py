"""DDP with two microbatches of gradient accumulation, as usually written: `no_sync()` on the first
(its gradients stay local), the all-reduce on the last. The mistake: clipping after every microbatch
instead of once before the optimizer step. The first call clips each rank's unreduced partial
gradient by its local norm, which changes the objective; the sum is clipped again."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from ..run import RankContext
from ..toy import TinyMLP, audited, mse, reference_step, regression_batch, rows_of, seeded, sgd

MAX_NORM = 0.5
NUM_MICROBATCHES = 2


def train_rank(ctx: RankContext) -> None:
    model = DistributedDataParallel(seeded(TinyMLP))
    local_batch = rows_of(regression_batch(), ctx.rank, ctx.world_size)
    microbatches = [rows_of(local_batch, i, NUM_MICROBATCHES) for i in range(NUM_MICROBATCHES)]
    optimizer = sgd(model)
    with audited(model, ctx.out_dir, max_norm=MAX_NORM, optimizer=optimizer) as audit:
        for i, (inputs, targets) in enumerate(microbatches):
            last = i == NUM_MICROBATCHES - 1
            with contextlib.nullcontext() if last else model.no_sync():
                (mse(model, inputs, targets) / NUM_MICROBATCHES).backward()
            # The mistake: this belongs after the loop, once.
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    global_batch = regression_batch()
    microbatches = [rows_of(global_batch, i, NUM_MICROBATCHES) for i in range(NUM_MICROBATCHES)]
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=microbatches)
