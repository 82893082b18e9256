"""DDP with a GradScaler, clipping before `scaler.unscale_`: the norm is measured on gradients still
multiplied by the loss scale, so the coefficient is the scale times too small and, once the scaler
divides the gradients, the threshold in effect is max_norm divided by the scale."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from ..run import RankContext
from ..toy import TinyMLP, audited, mse, reference_step, regression_batch, rows_of, seeded, sgd

MAX_NORM = 0.5
LOSS_SCALE = 1024.0


def train_rank(ctx: RankContext) -> None:
    model = DistributedDataParallel(seeded(TinyMLP))
    inputs, targets = rows_of(regression_batch(), ctx.rank, ctx.world_size)
    optimizer = sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
    with audited(model, ctx.out_dir, max_norm=MAX_NORM, optimizer=optimizer, scaler=scaler) as audit:
        scaler.scale(mse(model, inputs, targets)).backward()
        # The mistake: scaler.unscale_(optimizer) belongs here, before the norm is taken.
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        scaler.step(optimizer)
        scaler.update()


def train_reference(out_dir: Path) -> None:
    reference_step(
        seeded(TinyMLP),
        out_dir,
        max_norm=MAX_NORM,
        microbatches=[regression_batch()],
        scaler=torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE),
    )
