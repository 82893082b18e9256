"""FSDP2 with correct clipping, but rank 1's shard of fc1.weight holds an inf and a nan after the
gradient reduction (as a faulty link or kernel would leave it): the global norm becomes nan, and
clipping spreads the nan to every rank's gradients and weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch.distributed.device_mesh import init_device_mesh

import gradaudit

from ..launch import RankContext
from ..toy import STEP, TinyMLP, mse, reference_step, regression_batch, rows_of, seeded, sgd, shard_each_layer

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

MAX_NORM = 0.5
FAULTY_RANK = 1


def corrupt_shard(model: TinyMLP) -> None:
    """Simulated fault: two elements of this rank's fc1.weight gradient shard become inf and nan."""
    shard = cast("DTensor", model.fc1.weight.grad).to_local()
    shard[0, 0] = float("inf")
    shard[1, 2] = float("nan")


def train_rank(ctx: RankContext) -> None:
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
    model = shard_each_layer(seeded(TinyMLP), mesh)
    inputs, targets = rows_of(regression_batch(), ctx.rank, ctx.world_size)
    optimizer = sgd(model)
    with gradaudit.audit_step(
        model, ctx.out_dir, step=STEP, max_norm=MAX_NORM, norm_type=2.0, optimizer=optimizer, strict=True
    ) as audit:
        mse(model, inputs, targets).backward()
        if ctx.rank == FAULTY_RANK:
            corrupt_shard(model)
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=[regression_batch()])
