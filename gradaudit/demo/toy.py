"""The tiny models, fixed data and single-process reference step that the demo scenarios share.

Imported only inside a demo run (it imports torch at the top).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import STEP

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..capture.session import AuditStep, GroupSpec
    from .run import RankContext

ModuleT = TypeVar("ModuleT", bound=nn.Module)

MODEL_SEED = 1234
DATA_SEED = 5678
LEARNING_RATE = 0.1
GLOBAL_BATCH = 8


class TinyMLP(nn.Module):
    """Two linear layers: the model of the FSDP2 and DDP scenarios."""

    def __init__(self, d_in: int = 8, d_hidden: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.tanh(self.fc1(x)))
        return out


class TinyTPBlock(nn.Module):
    """An MLP block for tensor parallelism (fc1 column-wise, fc2 row-wise) and a LayerNorm after it,
    which tensor parallelism leaves as a plain tensor replicated on every rank."""

    def __init__(self, d_model: int = 8, d_hidden: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_model)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(self.fc2(torch.tanh(self.fc1(x))))
        return out


VOCAB = 16
D_MODEL = 8
SEQ_LEN = 4


class TinyLM(nn.Module):
    """Embedding, two blocks and an output head tied to the embedding: the pipeline scenario's model.

    A pipeline stage is this model with the other stage's modules deleted, so that every parameter keeps
    its full-model name; the last stage holds its own copy of the tied weight as `head.weight`.
    """

    def __init__(self, *, tie_head: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        self.block0 = nn.Linear(D_MODEL, D_MODEL)
        self.block1 = nn.Linear(D_MODEL, D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        if tie_head:
            self.head.weight = self.embed.weight
        else:
            self.head.weight = nn.Parameter(self.embed.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the stages this copy holds: the whole model, or one pipeline stage of it."""
        if hasattr(self, "embed"):
            x = torch.tanh(self.block0(self.embed(x)))
        if hasattr(self, "head"):
            x = self.head(torch.tanh(self.block1(x)))
        return x

    def keep_stage(self, stage: int) -> TinyLM:
        """Delete the modules of the other stage (stage 0: embed, block0; stage 1: block1, head)."""
        for name in ("block1", "head") if stage == 0 else ("embed", "block0"):
            delattr(self, name)
        return self


def seeded(factory: Callable[[], ModuleT]) -> ModuleT:
    """The same initial weights on every rank and in the reference."""
    torch.manual_seed(MODEL_SEED)
    return factory()


def regression_batch(
    *, d_in: int = 8, d_out: int = 4, target_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of the regression scenarios: inputs and targets, always the same values."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    inputs = torch.randn(GLOBAL_BATCH, d_in, generator=generator)
    targets = target_scale * torch.randn(GLOBAL_BATCH, d_out, generator=generator)
    return inputs, targets


def token_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of the language-model scenario: input tokens and next tokens."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def rows_of(batch: Sequence[torch.Tensor], index: int, count: int) -> tuple[torch.Tensor, ...]:
    """Member `index` of `count` (a data-parallel rank, a microbatch) takes its contiguous share of `batch`."""
    size = batch[0].shape[0] // count
    return tuple(t[index * size : (index + 1) * size] for t in batch)


def cross_entropy(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def mse(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(inputs), targets)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """Plain SGD: the next weights are a simple function of the clipped gradients."""
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def audited(
    model: nn.Module,
    out_dir: Path,
    *,
    max_norm: float,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None = None,
    groups: Mapping[str, GroupSpec] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> AuditStep:
    """`gradaudit.audit_step` as every demo step opens it: the demo's step, the 2-norm, and strict (a
    capture that fails stops the demo instead of leaving a sample short)."""
    from ..capture.session import audit_step

    return audit_step(
        model,
        out_dir,
        step=STEP,
        max_norm=max_norm,
        norm_type=2.0,
        optimizer=optimizer,
        scaler=scaler,
        groups=groups,
        aliases=aliases,
        strict=True,
    )


def reference_step(
    model: nn.Module,
    out_dir: Path,
    *,
    max_norm: float,
    microbatches: Sequence[tuple[torch.Tensor, ...]],
    loss_fn: Callable[..., torch.Tensor] = mse,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """One correct single-process step: accumulate every microbatch of the global batch, unscale when a
    scaler is used, clip once by the true norm, then step. Writes out_dir/step_<STEP>/."""
    optimizer = sgd(model)
    with audited(model, out_dir, max_norm=max_norm, optimizer=optimizer, scaler=scaler) as audit:
        for batch in microbatches:
            loss = loss_fn(model, *batch) / len(microbatches)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), max_norm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()


def fsdp2_mlp_step(
    ctx: RankContext,
    *,
    max_norm: float,
    clip: Callable[..., torch.Tensor],
    mesh_dims: Mapping[str, int] | None = None,
    target_scale: float = 1.0,
    fault: Callable[[TinyMLP], None] | None = None,
) -> None:
    """The FSDP2 scenarios' audited step: TinyMLP sharded per layer on a mesh of `mesh_dims` ({name: size};
    {"dp": world size} by default), each rank its rows of the regression batch, then backward, `fault` (a
    corruption of this rank's gradients, if any), `clip(parameters, max_norm)` and an SGD step."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = mesh_dims or {"dp": ctx.world_size}
    mesh = init_device_mesh("cpu", tuple(dims.values()), mesh_dim_names=tuple(dims))
    model = shard_each_layer(seeded(TinyMLP), mesh)
    inputs, targets = rows_of(regression_batch(target_scale=target_scale), ctx.rank, ctx.world_size)
    optimizer = sgd(model)
    with audited(model, ctx.out_dir, max_norm=max_norm, optimizer=optimizer) as audit:
        mse(model, inputs, targets).backward()
        if fault is not None:
            fault(model)
        audit.clip(clip, list(model.parameters()), max_norm)
        optimizer.step()


def shard_each_layer(model: ModuleT, mesh: DeviceMesh) -> ModuleT:
    """FSDP2 as usually applied: one fully_shard unit per child module that has parameters, then the root."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if next(child.parameters(), None) is not None:
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def hand_rolled_clip(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    reduce: Callable[[torch.Tensor], object] | None = None,
) -> torch.Tensor:
    """Clipping as the scenarios' mistakes write it by hand: the sum of squares of this rank's own
    gradients (a DTensor's local shard), all-reduced in place by `reduce` when one is given; its root
    is the total norm, and every gradient is scaled by min(1, max_norm / (norm + 1e-6)), as
    clip_grad_norm_ does."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    total_sq = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
    if reduce is not None:
        reduce(total_sq)
    total_norm = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coef)
    return total_norm
