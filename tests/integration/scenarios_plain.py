"""Worker code for plain-tensor stacks on 2 gloo ranks: DDP, pipeline stages with a tied embedding,
and Megatron-style tensor parallel (attributes on plain tensors).

Each scenario trains one step through gradaudit.audit_step into out_root/<scenario>/, once with the
stack's correct clipping and once with a deliberate mistake.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from models import MAX_NORM, batch, loss_of, rows, tied_net, tiny_net, token_batch
from scenarios_dtensor import apply_coef

import gradaudit


def _record_step(model, out_dir, run, **audit_kwargs) -> dict:
    """Run `run(audit)` (forward, backward, clip; returns the norm) inside audit_step, then step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradaudit.audit_step(
        model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True, **audit_kwargs
    ) as audit:
        norm = run(audit)
        opt.step()
    return {"returned_norm": float(norm), "path": str(audit.path)}


# -- DDP -------------------------------------------------------------------------------------------


def ddp(rank: int, world_size: int, out_root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    results = {}
    for name, clips in (("ddp_ok", 1), ("ddp_twice", 2)):
        model = DistributedDataParallel(tiny_net())

        def run(audit, model=model, clips=clips):
            loss_of(model(x), y).backward()
            for _ in range(clips):  # clipping twice before one step is what GA501 catches
                norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
            return norm

        results[name] = _record_step(model, os.path.join(out_root, name), run)
    return results


# -- pipeline stages ---------------------------------------------------------------------------------


class FirstStage(nn.Module):
    def __init__(self, full: nn.Module) -> None:
        super().__init__()
        self.embed, self.fc = full.embed, full.fc

    def forward(self, tokens):
        return torch.relu(self.fc(self.embed(tokens)))


class LastStage(nn.Module):
    """Keeps the full model's FQNs; lm_head holds its own copy of the tied embedding weight."""

    def __init__(self, full: nn.Module) -> None:
        super().__init__()
        self.norm = full.norm
        self.lm_head = nn.Linear(8, full.VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(full.embed.weight)
        self.lm_head.weight.shared = True  # Megatron's marker for a weight tied across stages

    def forward(self, hidden):
        return self.lm_head(self.norm(hidden))


def _pipeline_backward(stage, rank, tokens, targets, *, scaled=None) -> None:
    """One microbatch through two stages with send/recv, then the tied-embedding all-reduce. `scaled`
    (float16 with a GradScaler): the forward under autocast, the activations sent in float16, the last
    stage backpropagating scaled(loss)."""
    amp = torch.autocast("cpu", dtype=torch.float16, enabled=scaled is not None)
    if rank == 0:
        with amp:
            hidden = stage(tokens)
        dist.send(hidden.detach(), dst=1)
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=1)
        hidden.backward(grad)
        tied = stage.embed.weight.grad
    else:
        dtype = torch.float16 if scaled is not None else next(stage.parameters()).dtype
        hidden = torch.empty(tokens.shape[0], 8, dtype=dtype)
        dist.recv(hidden, src=0)
        hidden.requires_grad_(True)
        with amp:
            loss = torch.nn.functional.cross_entropy(stage(hidden), targets)
        (loss if scaled is None else scaled(loss)).backward()
        dist.send(hidden.grad, dst=0)
        tied = stage.lm_head.weight.grad
    dist.all_reduce(tied)  # both copies of the tied weight now hold its whole gradient


def _pipeline_clip(stage, rank, max_norm, *, across_stages: bool) -> torch.Tensor:
    grads = [p.grad for p in stage.parameters()]
    counted = [p.grad for n, p in stage.named_parameters() if not getattr(p, "shared", False)]
    total = sum(g.double().pow(2).sum() for g in counted)
    if across_stages:
        dist.all_reduce(total)
    norm = total.sqrt().float()
    apply_coef(grads, norm, max_norm)
    return norm


def pipeline(rank: int, world_size: int, out_root: str) -> dict:
    assert world_size == 2
    tokens, targets = token_batch()
    results = {}
    for name, across in (("pp_ok", True), ("pp_stage_only", False)):
        full = tied_net()
        stage = FirstStage(full) if rank == 0 else LastStage(full)
        aliases = {"lm_head.weight": "embed.weight"} if rank == 1 else None

        def run(audit, stage=stage, across=across):
            _pipeline_backward(stage, rank, tokens, targets)
            return audit.clip(_pipeline_clip, stage, rank, MAX_NORM, across_stages=across)

        results[name] = _record_step(
            stage, os.path.join(out_root, name), run, aliases=aliases, groups={"pp": dist.group.WORLD}
        )
    return results


# -- Megatron-style tensor parallel -----------------------------------------------------------------------


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class MegatronTiny(nn.Module):
    """TinyNet with fc1 column-parallel and fc2 row-parallel as plain tensors carrying Megatron attributes."""

    def __init__(self, full: nn.Module, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        rows_per = full.fc1.out_features // tp_size
        part = slice(tp_rank * rows_per, (tp_rank + 1) * rows_per)
        self.fc1_weight = nn.Parameter(full.fc1.weight.detach()[part].clone())
        self.fc1_bias = nn.Parameter(full.fc1.bias.detach()[part].clone())
        self.fc2_weight = nn.Parameter(full.fc2.weight.detach()[:, part].clone())
        self.fc2_bias = nn.Parameter(full.fc2.bias.detach().clone())
        for param, dim in ((self.fc1_weight, 0), (self.fc1_bias, 0), (self.fc2_weight, 1)):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
        self.norm, self.head = full.norm, full.head

    def forward(self, x):
        h = torch.relu(x @ self.fc1_weight.t() + self.fc1_bias)
        out = _AllReduceSum.apply(h @ self.fc2_weight.t()) + self.fc2_bias
        return self.head(self.norm(out))


def _megatron_clip(model, max_norm, *, count_duplicates_once: bool, group) -> torch.Tensor:
    tp_rank = dist.get_rank(group)
    total = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if getattr(p, "tensor_model_parallel", False) or tp_rank == 0 or not count_duplicates_once:
            total = total + p.grad.double().pow(2).sum()
    dist.all_reduce(total, group=group)
    norm = total.sqrt().float()
    apply_coef([p.grad for p in model.parameters()], norm, max_norm)
    return norm


MEGATRON_NAMES = {
    "fc1_weight": "fc1.weight",
    "fc1_bias": "fc1.bias",
    "fc2_weight": "fc2.weight",
    "fc2_bias": "fc2.bias",
}
"""How MegatronTiny's parameter names map to TinyNet's, for comparing with the reference."""


def megatron(rank: int, world_size: int, out_root: str) -> dict:
    tp_group = dist.new_group(list(range(world_size)))
    x, y = batch()
    results = {}
    for name, once in (("megatron_ok", True), ("megatron_replicas", False)):
        model = MegatronTiny(tiny_net(), rank, world_size)

        def run(audit, model=model, once=once):
            loss_of(model(x), y).backward()
            return audit.clip(_megatron_clip, model, MAX_NORM, count_duplicates_once=once, group=tp_group)

        results[name] = _record_step(model, os.path.join(out_root, name), run, groups={"tp": tp_group})
    return results


def all_plain_stacks(rank: int, world_size: int, out_root: str) -> dict:
    results = {}
    for scenario in (ddp, pipeline, megatron):
        results.update(scenario(rank, world_size, out_root))
    return results
