"""Run a function on N gloo ranks on CPU, each in its own spawned process, for integration tests.

    results = run_ranks(my_worker, world_size=4, args=(out_dir,))

`my_worker(rank, world_size, *args)` must be a module-level function (it is pickled by reference).
The process group is initialized before it runs and destroyed after. Its return value (picklable,
small) comes back in rank order. A worker that raises fails the caller with the worker's traceback;
ranks still running after `timeout_s` are killed (a hung collective is a test failure, not a hung suite).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_TIMEOUT_S = 90.0


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds their tracebacks."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: Sequence[Any], results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Plain pickle: tensors travel by value, not as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # the parent reports it; a worker must never die silently
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable,
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the values in rank order."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, rank, world_size, port, tuple(args), results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if all(p.exitcode is not None for p in procs) and results.empty():
                    break
                if any(p.exitcode not in (None, 0) and i not in outcomes for i, p in enumerate(procs)):
                    deadline = min(deadline, time.monotonic() + 5.0)
                continue
            outcomes[rank] = (status, value)
            if status == "error":
                # The other ranks are likely blocked in a collective with the failed one: give them
                # a moment to report their own error, then stop waiting.
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        killed = {rank for rank, proc in enumerate(procs) if proc.is_alive()}
        for rank in killed:
            procs[rank].kill()
        for proc in procs:
            proc.join(timeout=10)
    problems = []
    for rank in range(world_size):
        status, value = outcomes.get(rank, (None, None))
        if status == "error":
            problems.append(f"--- rank {rank} raised:\n{value}")
        elif status is None:
            code = procs[rank].exitcode
            if rank in killed:
                why = "hung and was killed (blocked in a collective with a failed rank, or past the timeout)"
            elif code is not None and code < 0:
                why = f"was killed by signal {-code}"
            else:
                why = f"exited with code {code}"
            problems.append(f"--- rank {rank} {why}; no result (timeout {timeout_s:.0f} s)")
    if problems:
        raise RankFailure(
            f"{fn.__module__}.{fn.__qualname__} on {world_size} ranks failed:\n" + "\n".join(problems)
        )
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]
