"""FSDP2 with correct clipping, but rank 1's shard of fc1.weight holds an inf and a nan after the
gradient reduction (as a faulty link or kernel would leave it): the global norm becomes nan, and
clipping spreads the nan to every rank's gradients and weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..run import RankContext
from ..toy import TinyMLP, fsdp2_mlp_step, reference_step, regression_batch, seeded

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
    fault = corrupt_shard if ctx.rank == FAULTY_RANK else None
    fsdp2_mlp_step(ctx, max_norm=MAX_NORM, clip=torch.nn.utils.clip_grad_norm_, fault=fault)


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyMLP), out_dir, max_norm=MAX_NORM, microbatches=[regression_batch()])
