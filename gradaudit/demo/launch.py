"""Runs a scenario's functions in fresh local CPU processes: its ranks joined by gloo, or one process alone.

Functions are named as "module:function" and resolved inside the child, so the calling process (the
CLI, a test) never imports torch or changes its global state (seeds, process groups).
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..localranks import free_port, prepare_rank_process, process_context

if TYPE_CHECKING:
    from multiprocessing.queues import SimpleQueue

DEFAULT_TIMEOUT_S = 120.0
"""Wall-clock limit for all ranks together; a demo step takes seconds, so this only catches hangs."""

COLLECTIVE_TIMEOUT_S = 60.0


class DemoRunFailed(RuntimeError):
    """A process of a demo scenario raised, died or hung: a bug in the scenario or an unusable machine.

    The message is one line; `detail` holds the failing process's whole traceback, when there is one.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        last_line = detail.strip().splitlines()[-1] if detail.strip() else ""
        super().__init__(f"{message}: {last_line}" if last_line else message)
        self.detail = detail


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What a scenario's per-rank function receives inside its process, after the group is up."""

    rank: int
    """This process's global rank."""
    world_size: int
    """Ranks of the scenario."""
    out_dir: Path
    """Where the sharded dump goes (audit_step writes out_dir/step_<N>/)."""


def run_ranks(target: str, *, world_size: int, out_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Spawn `world_size` processes, join them in a gloo group on 127.0.0.1, and call `target(ctx)` in each.

    Raises DemoRunFailed with the failing rank's traceback, or when the ranks outlive `timeout_s`.
    """
    _run(_rank_main, (world_size, free_port(), target, str(out_dir)), world_size, timeout_s)


def run_single(target: str, *, out_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Call `target(out_dir)` in one fresh process with no process group (the unsharded reference)."""
    _run(_single_main, (target, str(out_dir)), 1, timeout_s)


def _run(entry: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float) -> None:
    """Start `entry(index, *args)` in `nprocs` processes; stop them all as soon as one fails."""
    context = process_context()
    errors: SimpleQueue[tuple[int, str]] = context.SimpleQueue()
    processes = [
        context.Process(target=_guarded, args=(entry, index, args, errors), daemon=True)
        for index in range(nprocs)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.exitcode for p in processes]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                if errors.empty():
                    raise DemoRunFailed(
                        f"demo process {failed[0]} of {nprocs} died with exit code {codes[failed[0]]}"
                    )
                index, detail = errors.get()
                raise DemoRunFailed(f"demo process {index} of {nprocs} failed", detail)
            if all(code == 0 for code in codes):
                return
            if time.monotonic() > deadline:
                raise DemoRunFailed(f"{nprocs} demo process(es) did not finish within {timeout_s:.0f} s")
            processes[codes.index(None)].join(0.05)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(5)


def _guarded(
    entry: Callable[..., None], index: int, args: tuple[Any, ...], errors: SimpleQueue[tuple[int, str]]
) -> None:
    try:
        entry(index, *args)
    except BaseException:  # noqa: BLE001  reported to the parent, then re-raised as an exit
        errors.put((index, traceback.format_exc()))
        raise SystemExit(1) from None


def _resolve(target: str) -> Callable[..., None]:
    module_name, _, function_name = target.partition(":")
    function: Callable[..., None] = getattr(importlib.import_module(module_name), function_name)
    return function


def _single_main(index: int, target: str, out_dir: str) -> None:
    prepare_rank_process()
    _resolve(target)(Path(out_dir))


def _rank_main(rank: int, world_size: int, port: int, target: str, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    prepare_rank_process()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    _resolve(target)(RankContext(rank=rank, world_size=world_size, out_dir=Path(out_dir)))
    dist.barrier()
    # Only on success: a failing rank must report its error before its sockets close, or its peers'
    # "connection reset" errors would arrive first and hide the cause.
    dist.destroy_process_group()
