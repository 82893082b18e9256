"""FSDP2 done right: torch.nn.utils.clip_grad_norm_ on the DTensor gradients reduces over all shards."""

from __future__ import annotations

from pathlib import Path

import torch

from ..run import RankContext
from ..toy import TinyMLP, fsdp2_mlp_step, reference_step, regression_batch, seeded

MAX_NORM = 0.5


def train_rank(ctx: RankContext) -> None:
    fsdp2_mlp_step(ctx, max_norm=MAX_NORM, clip=torch.nn.utils.clip_grad_norm_)


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=[regression_batch()])
