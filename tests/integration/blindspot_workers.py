"""Worker code for the diagnosis' blind spots on 2 gloo ranks: a correct DTensor sequence-parallel step
(its LayerNorm gradients are pending partial sums), and DDP steps clipped by a hand-written clip before
the recorded one, in full and stats mode."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import gradaudit

SP_MAX_NORM = 0.1


class SequenceNet(nn.Module):
    """fc1 (column-parallel) -> relu -> fc2 (row-parallel, output sharded over the sequence) -> norm
    (SequenceParallel: its gradients are Partial(sum) over tp) -> head (column-parallel, replicated out)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(x)))))


def sequence_net() -> SequenceNet:
    torch.manual_seed(0)
    model = SequenceNet()
    with torch.no_grad():
        model.norm.weight.add_(torch.linspace(-0.3, 0.3, 8))
    return model


def sequence_batch() -> torch.Tensor:
    return torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))


def sequence_loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def single_process_sequence_norm() -> float:
    """The true gradient norm of the same step in one process, without any parallelism."""
    model = sequence_net()
    sequence_loss(model(sequence_batch())).backward()
    return float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))


def sequence_parallel(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    results = {}
    for name, mode in (("sp_ok", "full"), ("sp_ok_stats", "stats")):
        model = sequence_net()
        plan = {
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        }
        parallelize_module(model, mesh, plan)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gradaudit.audit_step(
            model, os.path.join(out_root, name), step=1, max_norm=SP_MAX_NORM, optimizer=opt, mode=mode
        ) as audit:
            sequence_loss(model(sequence_batch())).backward()
            placements = str(model.norm.weight.grad.placements)
            norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), SP_MAX_NORM)
            opt.step()
        results[name] = {"returned_norm": float(norm.full_tensor()), "norm_grad": placements}
    return results


DDP_MAX_NORM = 0.05


def ddp_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def ddp_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return torch.randn(4, 4, generator=gen), torch.randn(4, 2, generator=gen)


def hand_clip(params, max_norm: float) -> torch.Tensor:
    """A correct clip of DDP's (replicated) gradients that no interception knows: the code's own."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def clipped_before_the_recorded_call(rank: int, world_size: int, out_root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    results = {}
    for name, mode in (("unrecorded_clip", "full"), ("unrecorded_clip_stats", "stats")):
        model = DistributedDataParallel(ddp_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = ddp_batch(rank)
        with gradaudit.audit_step(
            model, os.path.join(out_root, name), step=1, max_norm=DDP_MAX_NORM, optimizer=opt, mode=mode
        ) as audit:
            torch.nn.functional.mse_loss(model(x), y).backward()
            first = hand_clip(list(model.parameters()), DDP_MAX_NORM)
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), DDP_MAX_NORM)
            opt.step()
        results[name] = {"first_norm": float(first)}
    return results


def no_clip_at_all(rank: int, world_size: int, out_root: str) -> dict:
    """The README's pattern with the clip call forgotten: backward and the optimizer step inside the audit."""
    from torch.nn.parallel import DistributedDataParallel

    results = {}
    for name, mode in (("no_clip", "full"), ("no_clip_stats", "stats")):
        model = DistributedDataParallel(ddp_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = ddp_batch(rank)
        with gradaudit.audit_step(
            model, os.path.join(out_root, name), step=1, max_norm=DDP_MAX_NORM, optimizer=opt, mode=mode
        ):
            torch.nn.functional.mse_loss(model(x), y).backward()
            used = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
            opt.step()
        results[name] = {"used_norm": used}
    return results


CLIP_VALUE = 0.01


def clipped_by_value(rank: int, world_size: int, out_root: str) -> dict:
    """clip_grad_value_ with max_norm declared: called directly (intercepted), and through audit.clip
    (recorded as an unknown clip: recognised from the clamp it leaves)."""
    from torch.nn.parallel import DistributedDataParallel

    results = {}
    for name, mode, through_audit in (
        ("value_clip", "full", False),
        ("value_clip_stats", "stats", False),
        ("value_clip_via_audit", "stats", True),
    ):
        model = DistributedDataParallel(ddp_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = ddp_batch(rank)
        with gradaudit.audit_step(
            model, os.path.join(out_root, name), step=1, max_norm=DDP_MAX_NORM, optimizer=opt, mode=mode
        ) as audit:
            torch.nn.functional.mse_loss(model(x), y).backward()
            if through_audit:
                audit.clip(torch.nn.utils.clip_grad_value_, model.parameters(), CLIP_VALUE)
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
            opt.step()
        results[name] = {}
    return results


def full_squares_all_reduced(params, max_norm: float) -> torch.Tensor:
    """The mistake: every rank sums the squares of the full gradients (full_tensor(), as ZeRO-3's
    safe_get_full_grad gives them), then all-reduces the sum again: sqrt(world size) x the true norm."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    total = sum(g.full_tensor().double().pow(2).sum() for g in grads)
    dist.all_reduce(total)
    norm = total.sqrt().float()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.to_local().mul_(coef)
    return norm


def every_copy_counted(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    results = {}
    for name, mode in (("every_copy", "full"), ("every_copy_stats", "stats")):
        model = ddp_net()
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = ddp_batch(rank)
        with gradaudit.audit_step(
            model, os.path.join(out_root, name), step=1, max_norm=DDP_MAX_NORM, optimizer=opt, mode=mode
        ) as audit:
            torch.nn.functional.mse_loss(model(x), y).backward()
            norm = audit.clip(full_squares_all_reduced, list(model.parameters()), DDP_MAX_NORM)
            opt.step()
        results[name] = {"reported": float(norm)}
    return results


def owned_norm_clip(params, max_norm: float) -> torch.Tensor:
    """The mistake of a hand-sharded optimizer: each rank clips every gradient by the norm of the
    parameters it owns (round-robin), so the ranks apply different coefficients to one update."""
    import torch.distributed as dist

    owned = params[dist.get_rank() :: dist.get_world_size()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in owned]))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return norm


def weights_drift(rank: int, world_size: int, out_root: str) -> dict:
    """Step 1 applies per-rank coefficients; step 2, clipped correctly, starts from weights that differ."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(ddp_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = ddp_batch(rank)
    for step, clip in ((1, owned_norm_clip), (2, torch.nn.utils.clip_grad_norm_)):
        with gradaudit.audit_step(
            model, os.path.join(out_root, "weights_drift"), step=step, max_norm=DDP_MAX_NORM, optimizer=opt
        ) as audit:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            audit.clip(clip, list(model.parameters()), DDP_MAX_NORM)
            opt.step()
    return {}


def all_blind_spots(rank: int, world_size: int, out_root: str) -> dict:
    """One spawn for every scenario: process start-up dominates the cost of these tests."""
    results = {}
    for scenario in (
        sequence_parallel,
        clipped_before_the_recorded_call,
        no_clip_at_all,
        clipped_by_value,
        every_copy_counted,
        weights_drift,
    ):
        results.update(scenario(rank, world_size, out_root))
    return results
