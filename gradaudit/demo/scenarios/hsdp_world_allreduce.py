"""HSDP on a (replicate, shard) mesh with a hand-rolled norm all-reduced over the whole world: the
replicate axis holds copies of the same shards, so each is counted once per replica."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import gradaudit

from ..launch import RankContext
from ..toy import (
    STEP,
    TinyMLP,
    clip_by_norm_,
    local_grads,
    mse,
    reference_step,
    regression_batch,
    rows_of,
    seeded,
    sgd,
    shard_each_layer,
    sum_of_squares,
)

MAX_NORM = 0.5


def clip_with_world_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The mistake: sums of squares all-reduced over every rank, replicas included."""
    grads = local_grads(parameters)
    total_sq = sum_of_squares(grads)
    dist.all_reduce(total_sq)
    total_norm = total_sq.sqrt()
    clip_by_norm_(grads, total_norm, max_norm)
    return total_norm


def train_rank(ctx: RankContext) -> None:
    mesh = init_device_mesh("cpu", (2, ctx.world_size // 2), mesh_dim_names=("replicate", "shard"))
    model = shard_each_layer(seeded(TinyMLP), mesh)
    inputs, targets = rows_of(regression_batch(), ctx.rank, ctx.world_size)
    optimizer = sgd(model)
    with gradaudit.audit_step(
        model, ctx.out_dir, step=STEP, max_norm=MAX_NORM, norm_type=2.0, optimizer=optimizer, strict=True
    ) as audit:
        mse(model, inputs, targets).backward()
        audit.clip(clip_with_world_norm, list(model.parameters()), MAX_NORM)
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=[regression_batch()])
