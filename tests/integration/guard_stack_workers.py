"""Worker code for gradaudit.guard on every stack and dtype: NUM_STEPS steps of a tiny model with the
guard attached once before the loop, each stack's correct clipping, and a short run per stack with one
known mistake at MISTAKE_STEP. Several stacks share one spawn (process start-up dominates the cost).

Every run returns what the guard found and, per step, the norm the clip returned (full value), so the
test compares it with the true norm on the trend."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from guard_workers import GuardLog, found
from models import MAX_NORM, batch, loss_of, rows, tied_net, tiny_net, token_batch
from scenarios_dtensor import local_norm_clip, per_mesh_clip, world_allreduced_clip
from scenarios_plain import FirstStage, LastStage, _pipeline_backward, _pipeline_clip

import gradaudit

NUM_STEPS = 20
MISTAKE_STEPS = 3
MISTAKE_STEP = 2
"""The mistake runs: MISTAKE_STEPS steps, the mistake made at MISTAKE_STEP only (and first)."""


def _full(norm: Any) -> float:
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


def _run(
    model: torch.nn.Module,
    out_dir: str,
    backward: Callable[[int], None],
    clip: Callable[[Any, int], Any],
    *,
    num_steps: int,
    scaler: Any = None,
    **guard_options: Any,
) -> dict:
    """`backward(step)` makes the step's gradients, `clip(guard, step)` clips them (returns the norm)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    norms = []
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        guard = gradaudit.guard(
            model, max_norm=MAX_NORM, optimizer=opt, out_dir=out_dir, scaler=scaler, **guard_options
        )
        try:
            for step in range(1, num_steps + 1):
                opt.zero_grad()
                backward(step)
                if scaler is not None:
                    norms.append(clip(guard, step))
                    scaler.step(opt)
                    scaler.update()
                else:
                    norms.append(_full(clip(guard, step)))
                    opt.step()
        finally:
            guard.remove()
    return {**found(guard, caught, log), "norms": norms, "out_dir": out_dir}


def _both(
    out_root: str, name: str, make: Callable[[], tuple], right: Callable, wrong: Callable, **kw
) -> dict:
    """The stack's correct run (NUM_STEPS) and its mistake run (wrong clip at MISTAKE_STEP)."""
    model, backward = make()
    found = {name: _run(model, os.path.join(out_root, name), backward, right, num_steps=NUM_STEPS, **kw)}
    model, backward = make()

    def mistaken(guard, step):
        return (wrong if step == MISTAKE_STEP else right)(guard, step)

    found[f"{name}_mistake"] = _run(
        model, os.path.join(out_root, f"{name}_mistake"), backward, mistaken, num_steps=MISTAKE_STEPS, **kw
    )
    return found


def _bf16(out_root: str, name: str, make: Callable[..., tuple], right: Callable, **kw) -> dict:
    """A correct run (NUM_STEPS) of the stack in bfloat16: `make(torch.bfloat16)`."""
    model, backward = make(torch.bfloat16)
    return {name: _run(model, os.path.join(out_root, name), backward, right, num_steps=NUM_STEPS, **kw)}


def _data_parallel_backward(model, rank: int, size: int, dtype=torch.float32):
    x, y = batch()
    x, y = rows(x, rank, size).to(dtype), rows(y, rank, size).to(dtype)

    def backward(step: int, scaled=None) -> None:
        """`scaled` (float16, see _fp16_runs): the forward under autocast, scaled(loss) backpropagated."""
        with torch.autocast("cpu", dtype=torch.float16, enabled=scaled is not None):
            loss = loss_of(model(x * step), y)
        (loss if scaled is None else scaled(loss)).backward()

    return backward


def _torch_clip(model):
    return lambda guard, step: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def _guarded(fn, *args):
    """A hand-written clip the guard cannot see by itself goes through guard.clip."""
    return lambda guard, step: guard.clip(fn, *args)


def _per_mesh(model):
    return _guarded(per_mesh_clip, list(model.parameters()), MAX_NORM)


# -- world size 2 ------------------------------------------------------------------------------------


def fsdp1(rank: int, world_size: int, out_root: str) -> dict:
    """FSDP1 in float32, with bfloat16 gradients of float32 parameters (keep_low_precision_grads:
    the norm FSDP1 returns is a bfloat16 sum), and in float16 with a ShardedGradScaler. The mistake:
    torch's clip of the flat local shards."""
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    low = MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, keep_low_precision_grads=True
    )
    found: dict = {}
    for name, precision in (("fsdp1", None), ("fsdp1_bf16", low)):
        models: list[Any] = []

        def make(precision=precision, models=models):
            model = FullyShardedDataParallel(
                tiny_net(), device_id=torch.device("cpu"), mixed_precision=precision
            )
            models[:] = [model]
            return model, _data_parallel_backward(model, rank, world_size)

        def right(guard, step, models=models):
            return models[0].clip_grad_norm_(MAX_NORM)

        def wrong(guard, step, models=models):
            return torch.nn.utils.clip_grad_norm_(models[0].parameters(), MAX_NORM)

        found.update(_both(out_root, name, make, right, wrong))
    # float16 as FSDP1 runs it: MixedPrecision in float16, its ShardedGradScaler and its own clip
    half = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
    wrap = partial(FullyShardedDataParallel, device_id=torch.device("cpu"), mixed_precision=half)
    make = _data_parallel(wrap, rank, world_size)
    clip = lambda model: lambda guard, step: model.clip_grad_norm_(MAX_NORM)  # noqa: E731
    return found | _sharded_fp16(rank, world_size, out_root, "fsdp1_fp16", make, clip=clip)


def tensor_parallel(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    models: list[Any] = []

    def make(dtype=torch.float32):
        model = tiny_net().to(dtype)
        parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        models[:] = [model]
        return model, _data_parallel_backward(model, 0, 1, dtype)  # every TP rank sees the whole batch

    def right(guard, step):
        return guard.clip(per_mesh_clip, list(models[0].parameters()), MAX_NORM)

    def wrong(guard, step):
        return guard.clip(world_allreduced_clip, list(models[0].parameters()), MAX_NORM)

    def all_dtensor():
        """float16: a scaler's unscale_ cannot take DTensor and plain gradients together (one foreach op
        gets both), so norm and head are replicated DTensors too, as torchtitan makes every parameter,
        and torch's clip_grad_norm_ takes them all."""
        model, backward = make()
        for module in (model.norm, model.head):
            distribute_module(
                module, mesh, input_fn=_replicated, output_fn=lambda m, out, mesh: out.to_local()
            )
        return model, backward

    return {
        **_both(out_root, "tp", make, right, wrong),
        **_bf16(out_root, "tp_bf16", make, right),
        **_sharded_fp16(rank, world_size, out_root, "tp_fp16", all_dtensor),
    }


def _replicated(module, inputs, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def pipeline(rank: int, world_size: int, out_root: str) -> dict:
    tokens, targets = token_batch()
    stages: list[Any] = []

    def make(dtype=torch.float32):
        full = tied_net()
        stage = (FirstStage(full) if rank == 0 else LastStage(full)).to(dtype)
        stages[:] = [stage]
        return stage, lambda step, scaled=None: _pipeline_backward(
            stage, rank, (tokens + step) % 10, targets, scaled=scaled
        )

    def clip(across: bool):
        return lambda guard, step: guard.clip(_pipeline_clip, stages[0], rank, MAX_NORM, across_stages=across)

    options = {
        "aliases": {"lm_head.weight": "embed.weight"} if rank == 1 else None,
        "groups": {"pp": dist.group.WORLD},
    }
    return {
        **_both(out_root, "pp", make, clip(True), clip(False), **options),
        **_bf16(out_root, "pp_bf16", make, clip(True), **options),
        **_sharded_fp16(rank, world_size, out_root, "pp_fp16", make, clip=lambda _: clip(True), **options),
    }


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for module in (model.fc1, model.fc2, model.norm, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_bf16(rank: int, world_size: int, out_root: str) -> dict:
    """FSDP2 with bfloat16 parameters and gradients (the norm torch returns is a bfloat16 sum)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    models: list[Any] = []

    def make():
        model = _fsdp2(tiny_net().to(torch.bfloat16), mesh)
        models[:] = [model]
        return model, _data_parallel_backward(model, rank, world_size, torch.bfloat16)

    def right(guard, step):
        return torch.nn.utils.clip_grad_norm_(models[0].parameters(), MAX_NORM)

    def wrong(guard, step):
        return guard.clip(local_norm_clip, list(models[0].parameters()), MAX_NORM)

    return _both(out_root, "fsdp2_bf16", make, right, wrong)


SKIPPED_STEP = 5
"""The fp16 run's step whose loss is inf: the scaler finds inf gradients and skips it."""


def _fp16_runs(
    rank: int,
    world_size: int,
    out_root: str,
    stack: str,
    make: Callable[[], tuple],
    make_scaler: Callable[[], Any],
    mistakes: tuple[str, ...] = ("before_unscale",),
    *,
    sharded: bool = False,
    clip: Callable[[Any], Callable] = _torch_clip,
    **guard_options: Any,
) -> dict:
    """Float16 autocast with a GradScaler: unscale_, clip, scaler.step, read one step late as on GPU.
    `make()` gives (model, backward(step, scaled)): the forward under float16 autocast, scaled(loss)
    backpropagated (by the rank that has a loss); `clip(model)` the stack's correct clip. At
    SKIPPED_STEP the gradients hold an inf and every rank's scaler skips the step (the loss is inf on
    every rank; `sharded`: only rank 0's shard has an inf, and the sharded scaler all-reduces found_inf).
    The mistakes, at MISTAKE_STEP: clipping before unscale_ ("before_unscale": the norm is the loss
    scale too big), and an inf in one rank's gradient only ("inf"; under DDP after the all-reduce: a
    GradScaler does not all-reduce found_inf)."""
    found = {}
    for mistake in (None, *mistakes):
        name = stack if mistake is None else f"{stack}{'_skip' if mistake == 'inf' else ''}_mistake"
        (model, fp16_backward), scaler = make(), make_scaler()
        scaler.scale(torch.ones(()))  # starts the loss scale on every rank (a first stage has no loss)
        clip_norm = clip(model)

        def backward(
            step: int, model=model, scaler=scaler, mistake=mistake, fp16_backward=fp16_backward
        ) -> None:
            inf = float("inf") if step == SKIPPED_STEP and not sharded else 1.0
            fp16_backward(step, lambda loss: scaler.scale(loss.float() * inf))
            one_rank = (step == SKIPPED_STEP and sharded) or (mistake == "inf" and step == MISTAKE_STEP)
            if rank == 0 and one_rank:
                grad = next(model.parameters()).grad
                (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")

        def fp16_clip(guard, step, scaler=scaler, mistake=mistake, clip_norm=clip_norm):
            unscale_first = not (mistake == "before_unscale" and step == MISTAKE_STEP)
            if unscale_first:
                scaler.unscale_(guard.optimizer)
            norm = _full(clip_norm(guard, step))
            return norm / (1.0 if unscale_first else scaler.get_scale())

        found[name] = _run(
            model,
            os.path.join(out_root, name),
            backward,
            fp16_clip,
            num_steps=MISTAKE_STEPS if mistake else NUM_STEPS,
            scaler=scaler,
            late=True,
            **guard_options,
        )
    return found


def _sharded_fp16(rank: int, world_size: int, out_root: str, stack: str, make, **kw) -> dict:
    """_fp16_runs with FSDP's ShardedGradScaler, which all-reduces found_inf over the world: the inf in
    rank 0's gradient at SKIPPED_STEP skips the step on every rank."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    def scaler() -> Any:
        return ShardedGradScaler("cpu", init_scale=2.0**10)

    return _fp16_runs(rank, world_size, out_root, stack, make, scaler, sharded=True, **kw)


def _data_parallel(wrap: Callable, rank: int, world_size: int) -> Callable[[], tuple]:
    """`make` of a data-parallel stack: wrap(TinyNet), each rank its rows of the batch."""

    def make() -> tuple:
        model = wrap(tiny_net())
        return model, _data_parallel_backward(model, rank, world_size)

    return make


def ddp_fp16(rank: int, world_size: int, out_root: str) -> dict:
    return _fp16_runs(
        rank,
        world_size,
        out_root,
        "ddp_fp16",
        _data_parallel(torch.nn.parallel.DistributedDataParallel, rank, world_size),
        lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10),
        ("before_unscale", "inf"),
    )


def fsdp2_fp16(rank: int, world_size: int, out_root: str) -> dict:
    """FSDP2 with its ShardedGradScaler, which all-reduces found_inf: an inf in rank 0's shard skips the
    step on both ranks, and the guard writes it as skipped."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    make = _data_parallel(lambda model: _fsdp2(model, mesh), rank, world_size)
    return _sharded_fp16(rank, world_size, out_root, "fsdp2_fp16", make)


def ddp_bf16(rank: int, world_size: int, out_root: str) -> dict:
    """DDP with bfloat16 parameters and gradients (DDP in float32 is in test_guard.py). The mistake: the
    ranks clip to different max_norms (a per-rank config), so they apply different coefficients."""
    models: list[Any] = []

    def make():
        model = torch.nn.parallel.DistributedDataParallel(tiny_net().to(torch.bfloat16))
        models[:] = [model]
        return model, _data_parallel_backward(model, rank, world_size, torch.bfloat16)

    def right(guard, step):
        return torch.nn.utils.clip_grad_norm_(models[0].parameters(), MAX_NORM)

    def wrong(guard, step):
        return torch.nn.utils.clip_grad_norm_(models[0].parameters(), MAX_NORM * (1 + rank))

    return _both(out_root, "ddp_bf16", make, right, wrong)


def world_of_two(rank: int, world_size: int, out_root: str) -> dict:
    found: dict = {}
    for stacks in (fsdp1, tensor_parallel, pipeline, fsdp2_bf16, ddp_fp16, fsdp2_fp16, ddp_bf16):
        found.update(stacks(rank, world_size, out_root))
    return found


# -- world size 4 -------------------------------------------------------------------------------------


def hsdp(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    models: list[Any] = []

    def make():
        model = tiny_net()
        fully_shard(model, mesh=mesh)
        models[:] = [model]
        return model, _data_parallel_backward(model, rank, world_size)

    def right(guard, step):
        return torch.nn.utils.clip_grad_norm_(models[0].parameters(), MAX_NORM)

    def wrong(guard, step):
        return guard.clip(world_allreduced_clip, list(models[0].parameters()), MAX_NORM)

    found = _both(out_root, "hsdp", make, right, wrong)
    model = tiny_net().to(torch.bfloat16)  # and a correct run in bfloat16
    fully_shard(model, mesh=mesh)
    models[:] = [model]
    backward = _data_parallel_backward(model, rank, world_size, torch.bfloat16)
    found["hsdp_bf16"] = _run(
        model, os.path.join(out_root, "hsdp_bf16"), backward, right, num_steps=NUM_STEPS
    )
    # and float16 with FSDP2's ShardedGradScaler (found_inf all-reduced over the world)
    make = _data_parallel(lambda model: fully_shard(model, mesh=mesh), rank, world_size)
    return found | _sharded_fp16(rank, world_size, out_root, "hsdp_fp16", make)


def fsdp2_over_tp(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    dp_index = mesh.get_coordinate()[0]
    models: list[Any] = []

    def make(dtype=torch.float32):
        model = tiny_net().to(dtype)
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        models[:] = [model]
        return model, _data_parallel_backward(model, dp_index, 2, dtype)

    def right(guard, step):
        return guard.clip(per_mesh_clip, list(models[0].parameters()), MAX_NORM)

    def wrong(guard, step):
        return guard.clip(local_norm_clip, list(models[0].parameters()), MAX_NORM)

    return {
        **_both(out_root, "fsdp2_tp", make, right, wrong),
        **_bf16(out_root, "fsdp2_tp_bf16", make, right),
        **_sharded_fp16(rank, world_size, out_root, "fsdp2_tp_fp16", make, clip=_per_mesh),
    }


def moe(rank: int, world_size: int, out_root: str) -> dict:
    """Megatron-style experts over expert-parallel groups of 2 (verdict_workers' TinyMoE); the mistake
    all-reduces the experts' squares over the whole world (each expert counted twice)."""
    from verdict_workers import EDP_GROUPS, EP_GROUPS, NUM_LOCAL_EXPERTS, TinyMoE

    ep_groups = [dist.new_group(list(g)) for g in EP_GROUPS]
    edp_groups = [dist.new_group(list(g)) for g in EDP_GROUPS]
    ep = next(pg for g, pg in zip(EP_GROUPS, ep_groups, strict=True) if rank in g)
    edp = next(pg for g, pg in zip(EDP_GROUPS, edp_groups, strict=True) if rank in g)
    ep_index = next(g for g in EP_GROUPS if rank in g).index(rank)
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    models: list[Any] = []

    def make(dtype=torch.float32):
        model = TinyMoE(ep_index * NUM_LOCAL_EXPERTS, NUM_LOCAL_EXPERTS).to(dtype)
        models[:] = [model]

        def backward(step: int, scaled=None) -> None:
            with torch.autocast("cpu", dtype=torch.float16, enabled=scaled is not None):
                loss = loss_of(model(x.to(dtype) * step), y.to(dtype))
            (loss if scaled is None else scaled(loss)).backward()
            for n, p in model.named_parameters():
                expert = "local_experts" in n
                dist.all_reduce(p.grad, group=edp if expert else None)
                p.grad /= 2 if expert else world_size

        return model, backward

    def expert_clip(model, max_norm: float, group) -> torch.Tensor:
        params = list(model.named_parameters())
        dense_sq = sum(p.grad.double().pow(2).sum() for n, p in params if "local_experts" not in n)
        expert_sq = sum(p.grad.double().pow(2).sum() for n, p in params if "local_experts" in n)
        dist.all_reduce(expert_sq, group=group)
        norm = (dense_sq + expert_sq).sqrt().float()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, p in params:
            p.grad.mul_(coef)
        return norm

    def clip(group):
        return lambda guard, step: guard.clip(expert_clip, models[0], MAX_NORM, group)

    groups = {"ep": [list(g) for g in EP_GROUPS]}
    return {
        **_both(out_root, "moe", make, clip(ep), clip(None), groups=groups),
        **_bf16(out_root, "moe_bf16", make, clip(ep), groups=groups),
        **_sharded_fp16(
            rank,
            world_size,
            out_root,
            "moe_fp16",
            make,
            clip=lambda _: clip(ep),
            groups=groups,
        ),
    }


def pipeline_over_fsdp2(rank: int, world_size: int, out_root: str) -> dict:
    """Two pipeline stages, each sharded with FSDP2 over 2 ranks, the embedding tied across stages; the
    mistake: each stage clips by its own norm (not summed over the stages)."""
    from scenarios_dtensor import _stage_clip, pipeline_fsdp2_backward
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp_shard"))
    pp_index, dp_index = mesh.get_coordinate()
    pp_group = mesh.get_group("pp")
    peer = mesh.mesh[1 - pp_index, dp_index].item()
    tokens, targets = token_batch()
    tokens, targets = rows(tokens, dp_index, 2), rows(targets, dp_index, 2)
    stages: list[Any] = []

    def make(dtype=torch.float32):
        full = tied_net()
        stage = (FirstStage(full) if pp_index == 0 else LastStage(full)).to(dtype)
        fully_shard(stage, mesh=mesh["dp_shard"])
        stages[:] = [stage]
        backward = lambda step, scaled=None: pipeline_fsdp2_backward(  # noqa: E731
            stage, pp_index, peer, pp_group, (tokens + step) % 10, targets, scaled=scaled
        )
        return stage, backward

    def clip(group):
        return lambda guard, step: guard.clip(_stage_clip, stages[0], MAX_NORM, pp_group=group)

    aliases = {"lm_head.weight": "embed.weight"} if pp_index == 1 else None
    options = {"aliases": aliases, "groups": {"pp": pp_group}}
    return {
        **_both(out_root, "pp_fsdp2", make, clip(pp_group), clip(None), **options),
        **_bf16(out_root, "pp_fsdp2_bf16", make, clip(pp_group), **options),
        **_sharded_fp16(
            rank,
            world_size,
            out_root,
            "pp_fsdp2_fp16",
            make,
            clip=lambda _: clip(pp_group),
            **options,
        ),
    }


def world_of_four(rank: int, world_size: int, out_root: str) -> dict:
    found: dict = {}
    for stacks in (hsdp, fsdp2_over_tp, moe, pipeline_over_fsdp2):
        found.update(stacks(rank, world_size, out_root))
    return found
