"""Two pipeline stages, each sharded with FSDP2 over its two data-parallel ranks, and each clipping with
torch.nn.utils.clip_grad_norm_ on its own parameters: the norm is reduced over the stage's
data-parallel group only, never across the stages. The output head is tied to the embedding of the
first stage (declared with `aliases=`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..run import RankContext
from ..toy import (
    D_MODEL,
    SEQ_LEN,
    TinyLM,
    audited,
    cross_entropy,
    reference_step,
    rows_of,
    seeded,
    sgd,
    shard_each_layer,
    token_batch,
)

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

MAX_NORM = 0.5
NUM_STAGES = 2


def _pipeline_step(model: TinyLM, stage: int, peer: int, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    """Forward and backward of one microbatch through both stages, activations sent point to point."""
    if stage == 0:
        hidden = model(tokens)
        dist.send(hidden.detach().contiguous(), dst=peer)
        hidden_grad = torch.empty_like(hidden)
        dist.recv(hidden_grad, src=peer)
        hidden.backward(hidden_grad)
    else:
        hidden = torch.empty(tokens.shape[0], SEQ_LEN, D_MODEL)
        dist.recv(hidden, src=peer)
        hidden.requires_grad_()
        cross_entropy(model, hidden, targets).backward()
        assert hidden.grad is not None  # filled by the backward above
        dist.send(hidden.grad.contiguous(), dst=peer)


def train_rank(ctx: RankContext) -> None:
    num_dp = ctx.world_size // NUM_STAGES
    mesh = init_device_mesh("cpu", (NUM_STAGES, num_dp), mesh_dim_names=("pp", "dp"))
    coordinate = mesh.get_coordinate()
    assert coordinate is not None  # every rank is in the mesh
    stage, dp_index = coordinate
    peer = ctx.rank + num_dp if stage == 0 else ctx.rank - num_dp
    model = shard_each_layer(seeded(lambda: TinyLM(tie_head=False)).keep_stage(stage), mesh["dp"])
    tokens, targets = rows_of(token_batch(), dp_index, num_dp)
    optimizer = sgd(model)
    tied = model.embed.weight if stage == 0 else model.head.weight
    with audited(
        model,
        ctx.out_dir,
        max_norm=MAX_NORM,
        optimizer=optimizer,
        groups={"pp": mesh.get_group("pp"), "dp": mesh.get_group("dp")},
        aliases={"head.weight": "embed.weight"} if stage == 1 else {},
    ) as audit:
        _pipeline_step(model, stage, peer, tokens, targets)
        # The first and last stage add up their parts of the tied weight's gradient (correct).
        dist.all_reduce(cast("DTensor", tied.grad).to_local(), group=mesh.get_group("pp"))
        # The mistake: each stage clips by the norm of its own parameters.
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        optimizer.step()


def train_reference(out_dir: Path) -> None:
    reference_step(
        seeded(TinyLM), out_dir, max_norm=MAX_NORM, microbatches=[token_batch()], loss_fn=cross_entropy
    )
