"""Tensor parallel (fc1 column-wise, fc2 row-wise) with a hand-rolled norm that sums every rank's local
gradients over the tensor-parallel group: right for the sharded weights, but the LayerNorm and fc2's
bias are replicated, so they are counted once per rank."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..run import RankContext
from ..toy import TinyTPBlock, audited, hand_rolled_clip, mse, reference_step, regression_batch, seeded, sgd

MAX_NORM = 0.5


def clip_with_tp_group_norm(
    parameters: Iterable[torch.Tensor], max_norm: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """The mistake: every local gradient summed over the group, including the replicated ones."""
    return hand_rolled_clip(parameters, max_norm, reduce=functools.partial(dist.all_reduce, group=group))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return regression_batch(d_in=8, d_out=8)


def train_rank(ctx: RankContext) -> None:
    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("tp",))
    model = parallelize_module(
        seeded(TinyTPBlock), mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    )
    inputs, targets = _batch()  # tensor-parallel ranks all see the whole batch
    optimizer = sgd(model)
    with audited(model, ctx.out_dir, max_norm=MAX_NORM, optimizer=optimizer) as audit:
        mse(model, inputs, targets).backward()
        audit.clip(clip_with_tp_group_norm, list(model.parameters()), MAX_NORM, mesh.get_group("tp"))
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    reference_step(seeded(TinyTPBlock), out_dir, max_norm=MAX_NORM, microbatches=[_batch()])
