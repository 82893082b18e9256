"""FSDP2 clipped by the norm of each rank's own `to_local()` shards: every shard is below max_norm, so
no rank clips, while the norm of the whole gradient is above it (the seed note's example)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..run import RankContext
from ..toy import TinyMLP, fsdp2_mlp_step, hand_rolled_clip, reference_step, regression_batch, seeded

MAX_NORM = 1.0
TARGET_SCALE = 1.5
"""Targets this large put the four shard norms between 0.48 and 0.93, and the whole gradient's near 1.37."""


def clip_local_shards(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The mistake: the norm of this rank's shards only, with no all-reduce across the shards."""
    return hand_rolled_clip(parameters, max_norm)


def train_rank(ctx: RankContext) -> None:
    fsdp2_mlp_step(ctx, max_norm=MAX_NORM, clip=clip_local_shards, target_scale=TARGET_SCALE)


def train_reference(out_dir: Path) -> None:
    reference_step(
        seeded(TinyMLP),
        out_dir,
        max_norm=MAX_NORM,
        microbatches=[regression_batch(target_scale=TARGET_SCALE)],
    )
