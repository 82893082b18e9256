"""HSDP on a (replicate, shard) mesh with a hand-rolled norm all-reduced over the whole world: the
replicate axis holds copies of the same shards, so each is counted once per replica."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from ..launch import RankContext
from ..toy import (
    TinyMLP,
    clip_by_norm_,
    fsdp2_mlp_step,
    local_grads,
    reference_step,
    regression_batch,
    seeded,
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
    mesh_dims = {"replicate": 2, "shard": ctx.world_size // 2}
    fsdp2_mlp_step(ctx, max_norm=MAX_NORM, clip=clip_with_world_norm, mesh_dims=mesh_dims)


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=[regression_batch()])
