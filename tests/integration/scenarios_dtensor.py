"""Worker code for DTensor stacks on 4 gloo ranks: FSDP2 (1-D), HSDP (2-D), tensor parallel, FSDP2 over TP.

Each scenario trains one step of TinyNet through gradaudit.audit_step, with the stack's correct
clipping and, where the issue asks for one, a deliberate mistake, into out_root/<scenario>/.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from models import MAX_NORM, batch, loss_of, rows, tiny_net

import gradaudit

CLIP_EPS = 1e-6


def apply_coef(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    for g in grads:
        g.mul_(coef)
    return coef


def local_of(grad):
    return grad.to_local() if hasattr(grad, "to_local") else grad


def local_norm_clip(params, max_norm: float) -> torch.Tensor:
    """The FSDP2 mistake: the norm of this rank's local shards only."""
    grads = [local_of(p.grad) for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    apply_coef(grads, norm, max_norm)
    return norm


def world_allreduced_clip(params, max_norm: float) -> torch.Tensor:
    """The HSDP / TP mistake: local squared norms summed over the whole world, replicas included."""
    grads = [local_of(p.grad) for p in params if p.grad is not None]
    total = sum(g.double().pow(2).sum() for g in grads)
    dist.all_reduce(total)
    norm = total.sqrt().float()
    apply_coef(grads, norm, max_norm)
    return norm


def per_mesh_clip(params, max_norm: float) -> torch.Tensor:
    """Correct clipping when parameters live on different meshes (FSDP2 over TP with plain modules,
    or TP beside plain replicated tensors): one DTensor norm per mesh, plain replicas counted once."""
    from torch.nn.utils import get_total_norm

    by_mesh: dict = {}
    plain = []
    for p in params:
        if p.grad is None:
            continue
        if hasattr(p.grad, "device_mesh"):
            by_mesh.setdefault(p.grad.device_mesh, []).append(p.grad)
        else:
            plain.append(p.grad)
    parts = [get_total_norm(grads).full_tensor() for grads in by_mesh.values()]
    if plain:
        parts.append(get_total_norm(plain))
    norm = torch.linalg.vector_norm(torch.stack(parts))
    apply_coef([local_of(g) for gs in by_mesh.values() for g in gs] + plain, norm, max_norm)
    return norm


def _step(model, out_dir, x, y, clip, **audit_kwargs) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradaudit.audit_step(
        model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True, **audit_kwargs
    ) as audit:
        loss = loss_of(model(x), y)
        loss.backward()
        norm = audit.clip(clip, list(model.parameters()), MAX_NORM)
        opt.step()
        audit.record(loss=loss.detach(), tokens=x.shape[0], loss_reduction="mean")
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return {"returned_norm": float(norm), "path": str(audit.path)}


def fsdp2(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    results = {}
    runs = (
        ("fsdp2_ok", torch.nn.utils.clip_grad_norm_, {}),
        ("fsdp2_local", local_norm_clip, {}),
        ("fsdp2_stats", torch.nn.utils.clip_grad_norm_, {"mode": "stats", "full_params": ["fc1.*"]}),
    )
    for name, clip, audit_kwargs in runs:
        model = tiny_net()
        for module in (model.fc1, model.fc2, model.norm, model.head):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        results[name] = _step(model, os.path.join(out_root, name), x, y, clip, **audit_kwargs)
    return results


def hsdp(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    results = {}
    for name, clip in (("hsdp_ok", torch.nn.utils.clip_grad_norm_), ("hsdp_world", world_allreduced_clip)):
        model = tiny_net()
        fully_shard(model, mesh=mesh)
        results[name] = _step(model, os.path.join(out_root, name), x, y, clip)
    return results


def tensor_parallel(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x, y = batch()
    results = {}
    for name, clip in (("tp_ok", per_mesh_clip), ("tp_replicas", world_allreduced_clip)):
        model = tiny_net()
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        results[name] = _step(model, os.path.join(out_root, name), x, y, clip)
    return results


def fsdp2_over_tp(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_coordinate()[0]
    x, y = batch()
    x, y = rows(x, dp_index, 2), rows(y, dp_index, 2)
    model = tiny_net()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return {"fsdp2_tp_ok": _step(model, os.path.join(out_root, "fsdp2_tp_ok"), x, y, per_mesh_clip)}


def _stage_clip(stage, max_norm: float, *, pp_group, dp_group=None) -> torch.Tensor:
    """Correct under pipeline + FSDP2: each stage's DTensor norm, squared, summed over the stages,
    the tied weight counted on the first stage only. With pp_group=None: the stage-only mistake; with
    dp_group: the stage norms' squares summed over the data-parallel group instead (every copy counted)."""
    from torch.nn.utils import get_total_norm

    grads = [p.grad for p in stage.parameters()]
    counted = [p.grad for n, p in stage.named_parameters() if pp_group is None or n != "lm_head.weight"]
    norm = get_total_norm(counted).full_tensor()
    if pp_group is not None or dp_group is not None:
        total = norm.double() ** 2
        dist.all_reduce(total, group=pp_group if dp_group is None else dp_group)
        norm = total.sqrt().float()
    apply_coef([local_of(g) for g in grads], norm, max_norm)
    return norm


def pipeline_fsdp2_backward(
    stage, pp_index: int, peer: int, pp_group, tokens, targets, *, scaled=None
) -> None:
    """One microbatch through the two FSDP2-sharded stages with send/recv to the peer stage's rank of
    the same data-parallel index, then the tied-embedding all-reduce over the stages. `scaled` (float16
    with a GradScaler): as in scenarios_plain._pipeline_backward."""
    amp = torch.autocast("cpu", dtype=torch.float16, enabled=scaled is not None)
    if pp_index == 0:
        with amp:
            hidden = stage(tokens)
        dist.send(hidden.detach(), dst=peer)
        grad = torch.empty_like(hidden)
        dist.recv(grad, src=peer)
        hidden.backward(grad)
        tied = stage.embed.weight.grad
    else:
        dtype = torch.float16 if scaled is not None else stage.lm_head.weight.dtype
        hidden = torch.empty(tokens.shape[0], 8, dtype=dtype)
        dist.recv(hidden, src=peer)
        hidden.requires_grad_(True)
        with amp:
            loss = torch.nn.functional.cross_entropy(stage(hidden), targets)
        (loss if scaled is None else scaled(loss)).backward()
        dist.send(hidden.grad, dst=peer)
        tied = stage.lm_head.weight.grad
    dist.all_reduce(tied.to_local(), group=pp_group)  # both stages' shards of the tied weight


def pipeline_fsdp2(rank: int, world_size: int, out_root: str) -> dict:
    """Two pipeline stages, each sharded with FSDP2 over 2 ranks, the embedding tied across stages."""
    from models import tied_net, token_batch
    from scenarios_plain import FirstStage, LastStage
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp_shard"))
    pp_index, dp_index = mesh.get_coordinate()
    pp_group = mesh.get_group("pp")
    peer = mesh.mesh[1 - pp_index, dp_index].item()
    tokens, targets = token_batch()
    tokens, targets = rows(tokens, dp_index, 2), rows(targets, dp_index, 2)
    results = {}
    dp_group = mesh.get_group("dp_shard")
    for name, group, wrong_dp in (
        ("pp_fsdp2_ok", pp_group, None),
        ("pp_fsdp2_stage_only", None, None),
        ("pp_fsdp2_dp_reduced", None, dp_group),
    ):
        full = tied_net()
        stage = FirstStage(full) if pp_index == 0 else LastStage(full)
        fully_shard(stage, mesh=mesh["dp_shard"])
        opt = torch.optim.SGD(stage.parameters(), lr=0.1)
        aliases = {"lm_head.weight": "embed.weight"} if pp_index == 1 else None
        out_dir = os.path.join(out_root, name)
        with gradaudit.audit_step(
            stage,
            out_dir,
            step=1,
            max_norm=MAX_NORM,
            optimizer=opt,
            strict=True,
            aliases=aliases,
            groups={"pp": pp_group},
        ) as audit:
            pipeline_fsdp2_backward(stage, pp_index, peer, pp_group, tokens, targets)
            norm = audit.clip(_stage_clip, stage, MAX_NORM, pp_group=group, dp_group=wrong_dp)
            opt.step()
        results[name] = {"returned_norm": float(norm), "path": str(audit.path)}
    return results


def all_dtensor_stacks(rank: int, world_size: int, out_root: str) -> dict:
    """One spawn for every DTensor scenario: process start-up dominates the cost of these tests."""
    results = {}
    for scenario in (fsdp2, hsdp, tensor_parallel, fsdp2_over_tp, pipeline_fsdp2):
        results.update(scenario(rank, world_size, out_root))
    return results
