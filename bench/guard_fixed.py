"""The guard's fixed host cost per checked step, and its cost in a short (GPU-sized) step, on CPU.

    python bench/guard_fixed.py           # the figures of bench/RESULTS.md (a few minutes)
    python bench/guard_fixed.py --tiny    # a smoke run

Fixed cost: a model of 16 and of 1,000 parameter tensors (Linear 8x8 layers), world size 1 and 2
(gloo), 200 checked steps each. Per step, the rank's CPU time (time.thread_time: waiting for the other
ranks' numbers is not host work, nor is what other processes take of a shared machine) inside the
guard's own hooks (its work around the clip call and after the optimizer step, posting and reading
its collective included; the clip and the step themselves are not in it), less one `torch.stack(torch._foreach_norm(...))` over the same local gradients timed in
the same step: the one fused norm pass the guard makes, which grows with the parameters. Target:
median <= 0.5 ms. That pass runs after the clip, which has just swept the gradients; the guard's own
runs before it, on gradients no Python code has read since the backward. So a second figure takes
its baseline from steps with the guard paused, interleaved with the checked ones: reading every
`.grad` and one fused pass, timed where the guard's own measuring runs (after the backward, before
the clip).

Beside a neighbour: the world-1 run again while a 2-rank DDP job without the guard steps on the same
machine. It shows what the second rank's processes cost the same code here (its caches and cores
shared): on a machine with a core or two per rank, the world-2 figure reads against this one.

Cold against warm: the guard's part of the step's sum (a fixed-size numpy computation, whatever the
model) is timed as the guard calls it and again at once with the same inputs (that second call is not
counted in the hooks' time): what the caches the model's step leaves cold cost code that does not
change with the model.

Net: the whole step's CPU time, checked against paused (interleaved; less the paused steps' extra
pass above): what the user's step pays for the guard, once torch's clip takes the guard's norm pass
instead of making its own (live/lending.py).

Short step: a model whose step takes 5-20 ms on one CPU thread; steps paused and checked alternate in
a shuffled order (the same on every rank); target: median checked / median paused <= 1.05.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from guard import _time_own_hooks


def _layers(num_tensors: int, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(num_tensors // 2)])


def _fixed(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Per checked step: the guard's hooks' time, and one fused norm pass over the same gradients."""
    import gradaudit
    from gradaudit.live.guard import Guard

    torch.set_num_threads(1)
    spent = [0.0]
    clock = time.thread_time  # this rank's CPU time: the wait for the other ranks' numbers is not host work
    _time_own_hooks(Guard, spent, clock)
    cold_warm = _time_cold_and_warm(spent, clock)
    model = _layers(config["tensors"], 8)
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    params = list(model.parameters())
    fused: list[float] = []
    own: list[float] = []
    at_its_moment: list[float] = []

    def step(*, baseline: bool = False) -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        if baseline:
            start = clock()
            torch.stack(torch._foreach_norm([p.grad for p in params], 2.0))
            at_its_moment.append(clock() - start)
        torch.nn.utils.clip_grad_norm_(params, 1e-3)
        grads = [p.grad for p in params]
        start = clock()
        torch.stack(torch._foreach_norm(grads, 2.0))
        fused.append(clock() - start)
        opt.step()

    with tempfile.TemporaryDirectory() as out:
        guard = gradaudit.guard(model, max_norm=1e-3, optimizer=opt, out_dir=out)
        for _ in range(10):
            step()
        fused.clear()
        checked: list[float] = []
        whole: dict[str, list[float]] = {"checked": [], "paused": []}
        for _ in range(config["steps"]):
            before, start = spent[0], clock()
            step()
            whole["checked"].append(clock() - start)
            own.append(spent[0] - before)
            checked.append(fused[-1])
            guard.pause()
            start = clock()
            step(baseline=True)
            whole["paused"].append(clock() - start - at_its_moment[-1])
            guard.resume()
        anomalies = list(guard.anomalies)
        guard.remove()
    assert not anomalies, f"a correct run was flagged: {anomalies}"
    return {
        "own": own,
        "fused": checked,
        "at_its_moment": at_its_moment,
        "cold_warm": cold_warm[10:],
        "whole": whole,
    }


def _time_cold_and_warm(spent: list[float], clock: Any) -> list[tuple[float, float]]:
    """Per call of the guard's part of the step's sum (`Reduction.contribution`: a fixed-size numpy
    computation whatever the model): its time as the guard calls it, then again at once with the same
    inputs; the second call's time is taken back out of `spent`. The ratio is what the caches the
    model's step leaves cold cost code that does not change with the model."""
    from gradaudit.live.fastpath import Reduction

    original, times = Reduction.contribution, []

    def both(self: Any, *args: Any) -> Any:
        start = clock()
        part = original(self, *args)
        middle = clock()
        original(self, *args)
        end = clock()
        spent[0] -= end - middle
        times.append((middle - start, end - middle))
        return part

    Reduction.contribution = both  # type: ignore[method-assign]
    return times


def _short(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """Step times with the guard paused and checking, interleaved."""
    import gradaudit

    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(config["batch"], 256, generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        if world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as out:
        guard = gradaudit.guard(model, max_norm=1.0, optimizer=opt, out_dir=out)
        times = interleaved(guard, step, config["rounds"])
        guard.remove()
    return times


def interleaved(guard: Any, step: Any, rounds: int) -> dict[str, list[float]]:
    """`step()`'s times with `guard` paused ("none") and checking ("guard"), after 5 warm-up steps, in
    a shuffled order each round (the same on every rank: they step together)."""
    times: dict[str, list[float]] = {"none": [], "guard": []}
    order = random.Random(0)
    for _ in range(5):
        step()
    for _ in range(rounds):
        kinds = ["none", "guard"] * 4
        order.shuffle(kinds)
        for kind in kinds:
            if kind == "none":
                guard.pause()
            times[kind].append(step())
            guard.resume()
    return times


def _worker(rank: int, world_size: int, port: int, name: str, config: dict, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = (_fixed if name == "fixed" else _short)(rank, world_size, config)
    finally:
        dist.destroy_process_group()


def _neighbour(rank: int, port: int, stop: Any) -> None:
    """A 2-rank DDP training loop without the guard, stepping until `stop` is set."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(_layers(16, 8))
    x = torch.randn(4, 8)
    stopping = torch.zeros(1)
    while not stopping.item():  # both ranks stop after the same step
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        stopping.fill_(float(stop.is_set()))
        dist.all_reduce(stopping)
    dist.destroy_process_group()


def _beside_neighbour(config: dict) -> dict:
    """`_run("fixed", 1, config)` while `_neighbour` runs on two other processes."""
    context = mp.get_context("spawn")
    stop = context.Event()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    neighbours = [context.Process(target=_neighbour, args=(rank, port, stop)) for rank in range(2)]
    for process in neighbours:
        process.start()
    try:
        time.sleep(3.0)  # both neighbours stepping
        return _run("fixed", 1, config)
    finally:
        stop.set()
        for process in neighbours:
            process.join()


def _run(name: str, world_size: int, config: dict) -> dict:
    if world_size == 1:
        return {0: (_fixed if name == "fixed" else _short)(0, 1, config)}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(world_size, port, name, config, results), nprocs=world_size, join=True)
    return dict(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    steps, rounds, batch = (20, 2, 64) if args.tiny else (200, 25, 512)
    for tensors in (16, 1000):
        for world_size in (1, 2, "1 beside a 2-rank neighbour"):
            config = {"tensors": tensors, "steps": steps}
            if isinstance(world_size, str):
                results = _beside_neighbour(config)
            else:
                results = _run("fixed", world_size, config)
            for rank, r in sorted(results.items()):
                extra = [o - f for o, f in zip(r["own"], r["fused"], strict=True)]
                fixed, fused = statistics.median(extra), statistics.median(r["fused"])
                print(
                    f"RATIO fixed host cost {tensors} tensors world {world_size} rank {rank} / 0.5 ms = "
                    f"{fixed / 5e-4:.3f} ({fixed * 1e6:.0f} us beyond the fused norm pass of {fused * 1e6:.0f} us; "
                    f"in the hooks {statistics.median(r['own']) * 1e6:.0f} us; median of {len(extra)})"
                )
                cold = statistics.median(c for c, _ in r["cold_warm"])
                warm = statistics.median(w for _, w in r["cold_warm"])
                print(
                    f"RATIO the guard's part of the sum, as called / again at once {tensors} tensors world "
                    f"{world_size} rank {rank} = {cold / warm:.2f} ({cold * 1e6:.0f} / {warm * 1e6:.0f} us)"
                )
                moment = statistics.median(r["at_its_moment"])
                beyond = statistics.median(r["own"]) - moment
                print(
                    f"RATIO fixed host cost beyond reading the gradients and one fused pass where the guard "
                    f"measures {tensors} tensors world {world_size} rank {rank} / 0.5 ms = {beyond / 5e-4:.3f} "
                    f"({beyond * 1e6:.0f} us; that baseline {moment * 1e6:.0f} us, from paused steps)"
                )
                checked, paused = (statistics.median(r["whole"][k]) for k in ("checked", "paused"))
                print(
                    f"RATIO net host cost, whole step checked - paused {tensors} tensors world {world_size} "
                    f"rank {rank} / 0.5 ms = {(checked - paused) / 5e-4:.3f} ({(checked - paused) * 1e6:.0f} us; "
                    f"steps {checked * 1e3:.2f} / {paused * 1e3:.2f} ms)"
                )
    for world_size in (1, 2):
        results = _run("short", world_size, {"rounds": rounds, "batch": batch})
        for rank, times in sorted(results.items()):
            none, guard = statistics.median(times["none"]), statistics.median(times["guard"])
            print(
                f"RATIO short step world {world_size} rank {rank} guard/none = {guard / none:.4f} "
                f"(step {none * 1e3:.1f} ms without, {guard * 1e3:.1f} ms checked; target <= 1.05)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
