"""FSDP2 clipped by the norm of each rank's own `to_local()` shards: every shard is below max_norm, so
no rank clips, while the norm of the whole gradient is above it (the seed note's example)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

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
    fsdp2_mlp_step(ctx, max_norm=MAX_NORM, clip=clip_local_shards, target_scale=TARGET_SCALE)


def train_reference(out_dir: Path) -> None:
    reference_step(
        seeded(TinyMLP),
        out_dir,
        max_norm=MAX_NORM,
        microbatches=[regression_batch(target_scale=TARGET_SCALE)],
    )
