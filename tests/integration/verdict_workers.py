"""Rank workers for the verdict tests: real sharded steps whose mistakes (or correctness) the
diagnosis must name exactly."""

from __future__ import annotations

import os

import torch
from models import MAX_NORM, batch, loss_of, rows, tiny_net

import gradaudit

NUM_MICROBATCHES = 2


def _microbatches(rank: int, world_size: int):
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    return [(rows(x, i, NUM_MICROBATCHES), rows(y, i, NUM_MICROBATCHES)) for i in range(NUM_MICROBATCHES)]


def _fsdp2_net(world_size: int) -> torch.nn.Module:
    """tiny_net with each layer and the root sharded by FSDP2 over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = tiny_net()
    for module in (model.fc1, model.fc2, model.norm, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_accumulation_clip_per_microbatch(rank: int, world_size: int, out_root: str) -> str:
    """FSDP2, no gradient sync on the first micro-batch, a clip after each micro-batch."""
    model = _fsdp2_net(world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out_dir = os.path.join(out_root, "fsdp2_accumulation")
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        for i, (xs, ys) in enumerate(_microbatches(rank, world_size)):
            model.set_requires_gradient_sync(i == NUM_MICROBATCHES - 1)
            (loss_of(model(xs), ys) / NUM_MICROBATCHES).backward()
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        opt.step()
    return str(audit.path.parent)


def ddp_accumulation_clip_per_microbatch(rank: int, world_size: int, out_root: str) -> str:
    """DDP, `no_sync()` on the first micro-batch (the usual accumulation), a clip after each."""
    import contextlib

    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out_dir = os.path.join(out_root, "ddp_accumulation")
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        for i, (xs, ys) in enumerate(_microbatches(rank, world_size)):
            sync = i == NUM_MICROBATCHES - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                (loss_of(model(xs), ys) / NUM_MICROBATCHES).backward()
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        opt.step()
    return str(audit.path.parent)


def fsdp2_local_clip(rank: int, world_size: int, out_root: str) -> str:
    """FSDP2 where each rank clips by the norm of its own `to_local()` shards (GA201)."""
    model = _fsdp2_net(world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()

    def local_clip(params, max_norm: float) -> torch.Tensor:
        grads = [p.grad.to_local() for p in params if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm

    out_dir = os.path.join(out_root, "fsdp2_local_clip")
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        loss_of(model(rows(x, rank, world_size)), rows(y, rank, world_size)).backward()
        audit.clip(local_clip, list(model.parameters()), MAX_NORM)
        opt.step()
    return str(audit.path.parent)


def fsdp2_dump_after_clipping(rank: int, world_size: int, out_root: str) -> str:
    """A correct FSDP2 step dumped by `gradaudit.dump()` from a hook after clipping, with no norm."""
    model = _fsdp2_net(world_size)
    x, y = batch()
    loss_of(model(rows(x, rank, world_size)), rows(y, rank, world_size)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    path = gradaudit.dump(model, os.path.join(out_root, "post_clip"), step=1, max_norm=MAX_NORM, strict=True)
    return str(path.parent)


class _Experts(torch.nn.Module):
    def __init__(self, first: int, num_local: int) -> None:
        super().__init__()
        layers = []
        for i in range(num_local):
            torch.manual_seed(100 + first + i)  # global expert first + i: the same weights on its replicas
            layer = torch.nn.Linear(8, 8)
            for p in layer.parameters():
                p.allreduce = False  # Megatron's mark of an expert parameter
            layers.append(layer)
        self.local_experts = torch.nn.ModuleList(layers)


class TinyMoE(torch.nn.Module):
    """Megatron-style: dense layers replicated on every rank, `mlp.experts.local_experts.<i>` local."""

    def __init__(self, first_expert: int, num_local: int) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)
        self.mlp = torch.nn.Module()
        self.mlp.experts = _Experts(first_expert, num_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h + sum(torch.tanh(e(h)) for e in self.mlp.experts.local_experts))


EP_GROUPS = ((0, 1), (2, 3))
EDP_GROUPS = ((0, 2), (1, 3))
NUM_LOCAL_EXPERTS = 2


def moe_expert_parallel(rank: int, world_size: int, out_root: str, mistake: str) -> str:
    """4 ranks, experts sharded over expert-parallel groups of 2 and replicated over the other pair.

    mistake: "none" (dense squares once + expert squares all-reduced over ep), "experts_over_dp" (expert
    squares all-reduced over the whole data-parallel world: every expert counted twice) or
    "experts_dropped" (experts left out of the norm).
    """
    import torch.distributed as dist

    assert world_size == 4
    ep_groups = [dist.new_group(list(g)) for g in EP_GROUPS]
    edp_groups = [dist.new_group(list(g)) for g in EDP_GROUPS]
    ep = next(pg for g, pg in zip(EP_GROUPS, ep_groups, strict=True) if rank in g)
    edp = next(pg for g, pg in zip(EDP_GROUPS, edp_groups, strict=True) if rank in g)
    ep_index = next(g for g in EP_GROUPS if rank in g).index(rank)
    model = TinyMoE(ep_index * NUM_LOCAL_EXPERTS, NUM_LOCAL_EXPERTS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    experts = [p for n, p in model.named_parameters() if "local_experts" in n]
    dense = [p for n, p in model.named_parameters() if "local_experts" not in n]

    def clip(max_norm: float) -> torch.Tensor:
        dense_sq = sum(p.grad.double().pow(2).sum() for p in dense)
        expert_sq = sum(p.grad.double().pow(2).sum() for p in experts)
        if mistake == "experts_dropped":
            expert_sq = expert_sq * 0
        else:
            dist.all_reduce(expert_sq, group=None if mistake == "experts_over_dp" else ep)
        norm = (dense_sq + expert_sq).sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in dense + experts:
            p.grad.mul_(coef)
        return norm

    out_dir = os.path.join(out_root, f"moe_{mistake}")
    with gradaudit.audit_step(
        model,
        out_dir,
        step=1,
        max_norm=MAX_NORM,
        optimizer=opt,
        groups={"ep": [list(g) for g in EP_GROUPS]},
        strict=True,
    ) as audit:
        loss_of(model(rows(x, rank, world_size)), rows(y, rank, world_size)).backward()
        for p in dense:
            dist.all_reduce(p.grad)
            p.grad /= world_size
        for p in experts:
            dist.all_reduce(p.grad, group=edp)
            p.grad /= 2
        audit.clip(clip, MAX_NORM)
        opt.step()
    return str(audit.path.parent)


class _Attention(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=True)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, dim=-1)
        return x + self.proj(weights @ v)


class _Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = _Attention(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


class QKVModel(torch.nn.Module):
    """An attention block with a qkv bias: the key bias's gradient is zero up to rounding (the softmax is
    shift-invariant), which Adam turns into full-size steps of noise."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.embed = torch.nn.Linear(8, dim)
        self.blocks = torch.nn.ModuleList([_Block(dim)])
        self.head = torch.nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def qkv_adamw_fsdp2(rank: int, world_size: int, out_dir: str) -> str:
    """A correct FSDP2 step of QKVModel with AdamW; at world size 1 (run_reference) its reference."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 6, 8, generator=gen), torch.randn(8, 3, generator=gen)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = QKVModel()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        loss_of(model(rows(x, rank, world_size)), rows(y, rank, world_size)).backward()
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        opt.step()
    return str(audit.path.parent)


def reference_of(fn_name: str, out_dir: str) -> str:
    """Run worker `fn_name` through gradaudit.run_reference (a fresh process: see the test)."""
    return gradaudit.run_reference(globals()[fn_name], 0, 1, out_dir)


def fsdp1_ignored_modules(rank: int, world_size: int, out_root: str) -> str:
    """A correct FSDP1 step with `ignored_modules=[model.norm]`: the code all-reduces the ignored
    parameters' gradients itself and clips with FSDP's clip_grad_norm_, which counts them once."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = tiny_net()
    fsdp = FullyShardedDataParallel(model, ignored_modules=[model.norm], device_id=torch.device("cpu"))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    x, y = batch()
    out_dir = os.path.join(out_root, "fsdp1_ignored")
    with gradaudit.audit_step(fsdp, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        loss_of(fsdp(rows(x, rank, world_size)), rows(y, rank, world_size)).backward()
        for p in model.norm.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        audit.clip(fsdp.clip_grad_norm_, MAX_NORM)
        opt.step()
    return str(audit.path.parent)


def fsdp2_hand_rolled_norm(rank: int, world_size: int, out_root: str, mistake: str) -> str:
    """FSDP2 with a hand-rolled norm: "averaged" all-reduces the ranks' local norms with AVG (legacy
    DeepSpeed style); "overflow" puts a finite 1e20 in one gradient and sums squares in float32."""
    import torch.distributed as dist

    model = _fsdp2_net(world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()

    def clip(params, max_norm: float) -> torch.Tensor:
        grads = [p.grad.to_local() for p in params if p.grad is not None]
        if mistake == "overflow":
            norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum()
            dist.all_reduce(norm)
            norm = norm.sqrt()
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            dist.all_reduce(norm, op=dist.ReduceOp.AVG)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return norm

    out_dir = os.path.join(out_root, f"fsdp2_{mistake}")
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        loss_of(model(rows(x, rank, world_size)), rows(y, rank, world_size)).backward()
        if mistake == "overflow" and rank == 0:
            model.fc1.weight.grad.to_local()[0, 0] = 1e20
        audit.clip(clip, list(model.parameters()), MAX_NORM)
        opt.step()
    return str(audit.path.parent)


def run_reference_inside_a_rank(rank: int, world_size: int) -> str:
    """The message run_reference gives when called from inside an initialized process group."""
    from gradaudit.errors import UsageError

    try:
        gradaudit.run_reference(print, "never called")
    except UsageError as exc:
        return str(exc)
    return ""
