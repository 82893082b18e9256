"""DDP with gradient accumulation where `no_sync()` wraps every microbatch, the last one included: no
gradient is ever all-reduced, so each replica clips and steps with its own local gradient and the
replicas drift apart."""

from __future__ import annotations

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
        with model.no_sync():  # the mistake: the last microbatch must run outside no_sync()
            for inputs, targets in microbatches:
                (mse(model, inputs, targets) / NUM_MICROBATCHES).backward()
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    global_batch = regression_batch()
    microbatches = [rows_of(global_batch, i, NUM_MICROBATCHES) for i in range(NUM_MICROBATCHES)]
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=microbatches)
