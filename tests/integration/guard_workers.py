"""Worker code for the guard on 2 gloo ranks: a few training steps of TinyNet under DDP or FSDP2 with
gradaudit.guard attached once before the loop, correct or with a deliberate clipping mistake."""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.distributed as dist
from models import MAX_NORM, batch, loss_of, rows, tiny_net

import gradaudit
from gradaudit.live.guard import GuardAnomaly

NUM_STEPS = 4


def with_trends(results: list[dict], out_root: str) -> list[dict]:
    """Each rank's result of each run, with the trend file rank 0 wrote in the run's folder (read once
    every rank has finished: a rank reading it while training may miss rank 0's last lines)."""
    from gradaudit.live.trend import TREND_FILE, read_trend

    for result in results:
        for name, run in result.items():
            path = os.path.join(out_root, name, TREND_FILE)
            run["trend"] = [line.to_json() for line in read_trend(path).lines] if os.path.exists(path) else []
    return results


def _wrapped(stack: str, world_size: int) -> torch.nn.Module:
    model = tiny_net()
    if stack == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    for module in (model.fc1, model.fc2, model.norm, model.head):
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def clip_local_shards(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """The FSDP2 mistake made with torch's own function: clip the local shards (their norm is local)."""
    shards = []
    for param in model.parameters():
        if param.grad is None:
            continue
        local = param.to_local().detach() if hasattr(param, "to_local") else param.detach()
        local.grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        shards.append(local)
    return torch.nn.utils.clip_grad_norm_(shards, max_norm)


def train(
    rank: int, world_size: int, out_dir: str, stack: str, mistake_at: tuple[int, ...], options: dict
) -> dict:
    """NUM_STEPS steps (`num_steps=`); at the steps in `mistake_at` the clip goes local (the others clip
    correctly); at the steps in `empty_at=` the last rank's batch is empty (its loss a sum over no rows
    divided by its usual count, so its gradients are zero before the reduction)."""
    empty_at = options.pop("empty_at", ())
    num_steps = options.pop("num_steps", NUM_STEPS)
    model = _wrapped(stack, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    raised = None
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        guard = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=out_dir, **options)
        try:
            for step in range(1, num_steps + 1):
                opt.zero_grad()
                if step in empty_at and rank == world_size - 1:
                    ((model(x[:0]) - y[:0]).pow(2).sum() / y.numel()).backward()
                else:
                    loss_of(model(x * step), y).backward()
                if step in mistake_at:
                    clip_local_shards(model, MAX_NORM)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                opt.step()
        except GuardAnomaly as exc:
            raised = {"step": exc.step, "codes": list(exc.codes), "at_step": step}
        finally:
            guard.remove()
    return {**found(guard, caught, log), "raised": raised}


class GuardLog(logging.Handler):
    """The lines the guard logs at debug level (what another rank warns; the repeats it folds)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> GuardLog:
        logger = logging.getLogger("gradaudit.live.guard")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("gradaudit.live.guard").removeHandler(self)


def found(guard, caught, log: GuardLog | None = None) -> dict:
    """What a rank's guard found: (step, codes) of its anomalies, its dumps, its warnings' texts, and
    the lines it logged at debug level."""
    return {
        "anomalies": [(step, list(codes)) for step, codes in guard.anomalies],
        "dumps": [str(p) for p in guard.dumps],
        "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
        "logged": [] if log is None else list(log.lines),
    }


def count_collectives(rank: int, world_size: int, out_dir: str, stack: str) -> dict:
    """Every collective issued inside the optimizer steps without the guard and with it, and the guard's
    own (on its process group) per checked step: (name, bytes sent by this rank), over NUM_STEPS + 2
    steps that clip twice at step MISTAKE_AT."""
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object")
    names += (
        "broadcast",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "gather",
        "scatter",
        "reduce",
        "barrier",
    )
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    counted = {"n": 0}
    per_step: dict[int, list[tuple[str, int]]] = {}
    guard = None

    def counting(name):
        def call(*args, **kwargs):
            counted["n"] += 1
            channel = guard and guard._channel
            if channel is not None and channel.group is not None and kwargs.get("group") is channel.group:
                sent = args[1] if name in ("all_gather_into_tensor", "all_gather_single") else args[0]
                per_step.setdefault(guard.step, []).append((name, sent.numel() * sent.element_size()))
            return originals[name](*args, **kwargs)

        return call

    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)

    def steps(model, opt, count, mistake_at=0):
        before = counted["n"]
        for step in range(1, count + 1):
            opt.zero_grad()
            loss_of(model(x * step), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if step == mistake_at:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)  # clipped twice: GA501
            opt.step()
        return counted["n"] - before

    model = _wrapped(stack, world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for name in originals:
        setattr(dist, name, counting(name))
    try:
        without = steps(model, opt, 3)
        guard = gradaudit.guard(
            model, max_norm=MAX_NORM, optimizer=opt, out_dir=os.path.join(out_dir, "count")
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with_guard = steps(model, opt, 3)
            per_step.clear()
            base = guard.step - 1
            steps(model, opt, COUNTED_STEPS, mistake_at=MISTAKE_AT)
            guard.remove()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {
        "without": without,
        "with": with_guard,
        "anomalies": [step - base for step, _ in guard.anomalies],
        "per_step": {step - base: collectives for step, collectives in per_step.items()},
    }


COUNTED_STEPS = 6
MISTAKE_AT = 4
