"""Worker code for the guard's fault tests: one training loop run without the guard and then with it,
once per fault, each fault made on one rank at one step, in the same rank processes. Each run returns
what a user would compare: a digest of the final weights, the guard's verdicts, its warnings, and how
long the rank took."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import signal
import time
import warnings

import torch
import torch.distributed as dist
from guard_workers import GuardLog, _wrapped, clip_local_shards
from models import MAX_NORM, batch, loss_of, rows

import gradaudit
from gradaudit.live import channel as channel_module
from gradaudit.live import guard as guard_module
from gradaudit.live.trend import TREND_FILE, read_trend

_ORIGINALS = (guard_module.report_of, guard_module.rank_dump)
NUM_STEPS = 8
MISTAKE_AT = 6
"""The step whose clipping is wrong in every run (a local clip under FSDP2, two clips under DDP)."""
FAULT_AT = 3
WAIT_S = 1.5


class Preempted(Exception):
    """What a SIGTERM handler raises, as torchelastic's SignalException (an Exception) does."""


Preempted.__name__ = "SignalException"


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        h.update(name.encode())
        h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """A full disk for this process: writes beyond `limit` bytes fail with EFBIG (SIGXFSZ ignored)."""
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous_handler)


def _inject(fault: str, guard, rank: int, fault_rank: int, step_of) -> None:
    """Arm `fault` on the guard of `fault_rank` (`step_of()`: the training step under way)."""
    if rank != fault_rank:
        return

    def at_fault_step(original, error=None):
        def call(*args, **kwargs):
            if step_of() == FAULT_AT:
                raise error or RuntimeError(f"injected {fault}")
            return original(*args, **kwargs)

        return call

    if fault == "raise_measure":
        guard._summary.measure = at_fault_step(guard._summary.measure)
    elif fault == "raise_pack":
        guard._vector = at_fault_step(guard._vector)
    elif fault == "raise_judge":
        original = guard_module.report_of
        guard_module.report_of = at_fault_step(original)
    elif fault == "raise_send":
        guard._channel.post_sum = at_fault_step(guard._channel.post_sum)
    elif fault == "raise_read":
        guard._channel.read = at_fault_step(guard._channel.read, channel_module.ChannelError("injected"))
    elif fault == "raise_dump":
        guard_module.rank_dump = _at_step(guard_module.rank_dump, step_of, MISTAKE_AT)
    elif fault == "raise_capture":
        guard._begin_capture = _at_step(guard._begin_capture, step_of, MISTAKE_AT + 1)
    elif fault == "raise_on_verdict":

        def on_verdict(line):
            if line.step == FAULT_AT:
                raise ValueError("the user's logger failed")

        guard.on_verdict = on_verdict


def _at_step(original, step_of, step):
    def call(*args, **kwargs):
        if step_of() in (step, step - 1):  # the step itself, or a verdict read before it ends
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    return call


def _train(rank, world_size, stack, out_dir, *, guarded, fault=None, fault_rank=1, guard_options=None):
    model = _wrapped(stack, world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    guard = None
    current = {"step": 0}
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        started = time.monotonic()
        if guarded:
            if fault == "existing_dump" and rank == fault_rank:
                os.makedirs(os.path.join(out_dir, f"step_{MISTAKE_AT}"), exist_ok=True)
                with open(os.path.join(out_dir, f"step_{MISTAKE_AT}", "rank_00001.safetensors"), "wb") as f:
                    f.write(b"left by an earlier attempt")
            if fault == "out_dir_under_a_file":
                with open(os.path.join(out_dir, "a_file"), "w") as f:
                    f.write("x")
                out_dir = os.path.join(out_dir, "a_file", "audit")
            dist.barrier()
            guard = gradaudit.guard(
                model,
                max_norm=MAX_NORM,
                optimizer=opt,
                out_dir=out_dir,
                wait_s=WAIT_S,
                **(guard_options or {}),
            )
            _inject(fault, guard, rank, fault_rank, lambda: current["step"])
        for step in range(1, NUM_STEPS + 1):
            current["step"] = step
            if guard is not None and rank == fault_rank and step == FAULT_AT:
                if fault == "pause_alone":
                    guard.pause()  # out of turn: the other rank goes on checking
                elif fault == "remove_alone":
                    guard.remove()
            if guard is not None and rank == fault_rank and fault == "pause_alone" and step == FAULT_AT + 2:
                guard.resume()
            opt.zero_grad()
            loss_of(model(x * step), y).backward()
            if step == MISTAKE_AT and stack == "fsdp2":
                clip_local_shards(model, MAX_NORM)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                if step == MISTAKE_AT:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            if fault == "skipped_step" and rank == fault_rank and step == FAULT_AT:
                continue  # `if loss_is_finite: opt.step()`, decided on this rank alone
            with _fault_around_step(fault, rank, fault_rank, step, out_dir):
                opt.step()
        elapsed = time.monotonic() - started
        if guard is not None:
            guard.remove()
        guard_module.report_of, guard_module.rank_dump = _ORIGINALS
    dist.barrier()
    trend_path = os.path.join(out_dir, TREND_FILE)
    return {
        "digest": _digest(model),
        "elapsed": elapsed,
        "anomalies": [] if guard is None else [(s, list(c)) for s, c in guard.anomalies],
        "skipped_steps": [] if guard is None else [(s, list(r)) for s, r in guard.skipped_steps],
        "dumps": [] if guard is None else [str(p) for p in guard.dumps],
        "warnings": [str(w.message) for w in caught if "gradaudit" in str(w.message)],
        "logged": list(log.lines),
        "trend": [(t.step, list(t.codes)) for t in read_trend(trend_path).lines]
        if os.path.isfile(trend_path)
        else [],
    }


@contextlib.contextmanager
def _fault_around_step(fault, rank, fault_rank, step, out_dir):
    """Faults of the disk, made around the optimizer step (the guard writes inside its hooks)."""
    if rank == fault_rank and fault == "full_disk_trend" and step in (FAULT_AT, FAULT_AT + 1):
        size = os.path.getsize(os.path.join(out_dir, TREND_FILE))
        with _file_size_limit(size + 20):  # the next line is cut short, the one after fails outright
            yield
    elif rank == fault_rank and fault == "full_disk_dump" and step == MISTAKE_AT:
        with _file_size_limit(1024):
            yield
    else:
        yield


def faults(rank: int, world_size: int, out_root: str, stack: str, names: tuple[str, ...]) -> dict:
    """The run without the guard (with and without a skipped step), then the guard's runs: under DDP a
    skipped step whose weights a weight check compares, unfaulted, then one per fault in `names`;
    each in its own folder under out_root."""
    results = {
        "unguarded": _train(rank, world_size, stack, os.path.join(out_root, "unguarded"), guarded=False),
        "unguarded_skip": _train(
            rank,
            world_size,
            stack,
            os.path.join(out_root, "unguarded_skip"),
            guarded=False,
            fault="skipped_step",
        ),
    }
    if stack == "ddp":  # replicated weights, compared after the skipped step (weights_every=2: at step 4)
        results["skipped_step_weighed"] = _train(
            rank,
            world_size,
            stack,
            os.path.join(out_root, "skipped_step_weighed"),
            guarded=True,
            fault="skipped_step",
            guard_options={"weights_every": 2},
        )
    for name in ("clean", *names):
        out_dir = os.path.join(out_root, name)
        os.makedirs(out_dir, exist_ok=True)
        fault_rank = 0 if name in ("full_disk_trend",) else 1
        results[name] = _train(
            rank,
            world_size,
            stack,
            out_dir,
            guarded=True,
            fault=None if name == "clean" else name,
            fault_rank=fault_rank,
        )
    return results


def terminated_while_dumping(rank: int, world_size: int, out_dir: str) -> dict:
    """Rank 1 gets SIGTERM while it writes the dump of the wrong step; its handler raises (as
    torchelastic's does). What each rank saw, and what is in the step's folder afterwards."""
    from gradaudit.dumpfile import writer

    def handler(signum, frame):
        raise Preempted("SIGTERM")

    signal.signal(signal.SIGTERM, handler)
    if rank == 1:
        original = writer.write_safetensors

        def interrupted(handle, *args, **kwargs):
            handle.write(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs before this returns
            return original(handle, *args, **kwargs)

        writer.write_safetensors = interrupted
    try:
        result = _train(rank, world_size, "ddp", out_dir, guarded=True)
        return {"ended": "finished", **result}
    except Preempted:
        return {"ended": "preempted"}
    except Exception as exc:
        return {"ended": f"raised {type(exc).__name__}"}


def changes(rank: int, world_size: int, out_dir: str, stack: str) -> dict:
    """14 correct steps of TinyNet whose head starts out of the optimizer: at step 4 it is added as a
    param group, at step 8 the model loads its own state dict. The head starts frozen (and is unfrozen
    at step 4) under FSDP2 and under "ddp_unfreeze"; under "ddp" it is trained from the start (DDP
    reduces only the parameters that were trained when it was built)."""
    from models import tiny_net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_net()
    frozen = stack != "ddp"
    model.head.requires_grad_(not frozen)
    if stack.startswith("ddp"):
        model = torch.nn.parallel.DistributedDataParallel(model)
        inner = model.module
    else:
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
        for module in (model.fc1, model.fc2, model.norm, model.head):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        inner = model
    opt = torch.optim.AdamW(
        [p for name, p in inner.named_parameters() if not name.startswith("head")], lr=0.01
    )
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    with warnings.catch_warnings(record=True) as caught, GuardLog() as log:
        warnings.simplefilter("always")
        guard = gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=out_dir, wait_s=WAIT_S)
        for step in range(1, 15):
            if step == 4:
                inner.head.requires_grad_(True)
                opt.add_param_group({"params": list(inner.head.parameters())})
            if step == 8:
                model.load_state_dict(model.state_dict())
            opt.zero_grad()
            loss_of(model(x * step), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
        guard.remove()
    trend_path = os.path.join(out_dir, TREND_FILE)
    return {
        "anomalies": [(s, list(c)) for s, c in guard.anomalies],
        "warnings": [str(w.message) for w in caught if "gradaudit" in str(w.message)],
        "logged": list(log.lines),
        "trend": [(t.step, list(t.codes)) for t in read_trend(trend_path).lines]
        if os.path.isfile(trend_path)
        else [],
        "groups": [g.name for g in guard.groups],
    }
