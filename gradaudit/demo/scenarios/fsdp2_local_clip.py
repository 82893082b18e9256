"""FSDP2 clipped by the norm of each rank's own `to_local()` shards: every shard is below max_norm, so
no rank clips, while the norm of the whole gradient is above it (the seed note's example)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
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

MAX_NORM = 1.0
TARGET_SCALE = 1.5
"""Targets this large put the four shard norms between 0.48 and 0.93, and the whole gradient's near 1.37."""


def clip_local_shards(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The mistake: the norm of this rank's shards only, with no all-reduce across the shards."""
    grads = local_grads(parameters)
    total_norm = sum_of_squares(grads).sqrt()
    clip_by_norm_(grads, total_norm, max_norm)
    return total_norm


def train_rank(ctx: RankContext) -> None:
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
    model = shard_each_layer(seeded(TinyMLP), mesh)
    inputs, targets = rows_of(regression_batch(target_scale=TARGET_SCALE), ctx.rank, ctx.world_size)
    optimizer = sgd(model)
    with gradaudit.audit_step(
        model, ctx.out_dir, step=STEP, max_norm=MAX_NORM, norm_type=2.0, optimizer=optimizer, strict=True
    ) as audit:
        mse(model, inputs, targets).backward()
        audit.clip(clip_local_shards, list(model.parameters()), MAX_NORM)
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    reference_step(
        seeded(TinyMLP),
        out_dir,
        max_norm=MAX_NORM,
        microbatches=[regression_batch(target_scale=TARGET_SCALE)],
    )
