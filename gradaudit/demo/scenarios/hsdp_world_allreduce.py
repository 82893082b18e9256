"""HSDP on a (replicate, shard) mesh with a hand-rolled norm all-reduced over the whole world: the
replicate axis holds copies of the same shards, so each is counted once per replica."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

from ..run import RankContext
from ..toy import TinyMLP, fsdp2_mlp_step, hand_rolled_clip, reference_step, regression_batch, seeded

MAX_NORM = 0.5


def clip_with_world_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The mistake: sums of squares all-reduced over every rank, replicas included."""
    return hand_rolled_clip(parameters, max_norm, reduce=dist.all_reduce)


def train_rank(ctx: RankContext) -> None:
    mesh_dims = {"replicate": 2, "shard": ctx.world_size // 2}
    fsdp2_mlp_step(ctx, max_norm=MAX_NORM, clip=clip_with_world_norm, mesh_dims=mesh_dims)


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=[regression_batch()])
