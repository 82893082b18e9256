"""Local CPU rank processes, the one launcher of the demo and the test helpers: a function run on N
gloo ranks, each in its own process.

    outcomes = launch(my_worker, world_size=4, args=(out_dir,))    # every rank's outcome
    values = run_ranks(my_worker, world_size=4, args=(out_dir,))   # values, or RankFailure

`my_worker(rank, world_size, *args)` and its arguments must be picklable by reference: a function
defined at module level in a module the rank processes can import (a package, or a test file that
pytest imported by its default `--import-mode=prepend`). The process group is initialized from a
file store in a fresh temporary folder (no port to collide with under pytest-xdist) before it runs and
destroyed after it. A rank that raises is reported with its traceback; ranks still running after
`timeout_s`, or a few seconds after another rank failed, are killed: a hung collective is a test
failure, not a hung suite.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from .capture.reference_run import free_port, launcher_variables
from .errors import UsageError

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue
    from types import TracebackType

StartMethod = Literal["forkserver", "spawn"]
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor"]
"""Imported once by the fork server, so that each rank starts in a fraction of a second, not seconds."""


DEFAULT_TIMEOUT_S = 120.0
GRACE_S = 5.0
"""How long the other ranks may still report after one failed (a rank blocked in a collective with the
failed one often gets its own error within this time; otherwise it is killed)."""
COLLECTIVE_TIMEOUT_S = 60.0


class RankFailure(AssertionError):
    """One or more ranks raised, died or hung; the message holds each failed rank's traceback."""


class NotSendableError(UsageError):
    """A function or argument given to the ranks cannot be sent to another process."""


@dataclass(frozen=True, kw_only=True)
class RankOutcome:
    """How one rank ended."""

    rank: int
    """The rank."""
    status: Literal["ok", "raised", "lost"]
    """ok: returned; raised: raised an exception (a skip included); lost: died, hung, or never reported."""
    value: Any = None
    """What the function returned (status ok)."""
    exc_type: str = ""
    """The raised exception's class as module.qualname, e.g. "_pytest.outcomes.Skipped"."""
    message: str = ""
    """str() of the raised exception, or why the rank was lost."""
    traceback: str = ""
    """The raised exception's formatted traceback, as the rank printed it."""
    reported: int | None = None
    """The rank's place in the order the reports arrived (0: first), None when it sent none: the rank
    that failed first most often caused the failures of the others, blocked in collectives with it."""


MODULE_LEVEL_HINT = (
    "define it at module level in the test file or a package (not a lambda, a nested function or a local "
    "class), and pass only picklable arguments"
)


def sendable(what: str, value: object, hint: str = MODULE_LEVEL_HINT) -> bytes:
    """`value` pickled, or NotSendableError naming `what` and how to make it sendable."""
    try:
        return pickle.dumps(value)
    except Exception as exc:  # noqa: BLE001  pickle raises several types; all mean the same here
        raise NotSendableError(
            f"{what} cannot be sent to the rank processes ({type(exc).__name__}: {exc}); {hint}"
        ) from None


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: StartMethod = "forkserver",
    init_group: bool = True,
) -> tuple[RankOutcome, ...]:
    """Run `fn(rank, world_size, *args)` in `world_size` fresh processes; return every rank's outcome.

    With `init_group`, each process first joins a gloo group of all of them; without, it runs alone
    (for `gradaudit.run_reference`, which starts its own). `start_method="forkserver"` forks the ranks
    from one server that has imported torch already (fast; the ranks see the environment of the moment
    the server started); "spawn" starts each from scratch with the current environment.
    """
    if world_size < 1:
        raise UsageError(f"world_size must be at least 1, got {world_size}")
    payload = sendable(f"{getattr(fn, '__qualname__', fn)!r} and its arguments", (fn, tuple(args)))
    # A fork server that has imported torch already when the platform has one and it is asked for.
    context: ForkServerContext | SpawnContext = multiprocessing.get_context("spawn")
    if start_method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
    results: Queue[tuple[int, str, bytes]] = context.Queue()
    store_dir = tempfile.mkdtemp(prefix="gradaudit-ranks-")
    port = free_port()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, payload, store_dir, port, init_group, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    try:
        for process in processes:
            process.start()
        reports, killed, timed_out = _collect(processes, results, timeout_s)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    return tuple(
        _outcome(rank, reports, processes[rank], rank in killed, timed_out, timeout_s)
        for rank in range(world_size)
    )


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    start_method: StartMethod = "forkserver",
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the values in rank order.

    Raises RankFailure with every failed rank's traceback when any rank raised, died or hung."""
    outcomes = launch(fn, world_size, args, timeout_s=timeout_s, start_method=start_method)
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        raise RankFailure(f"{name} on {world_size} ranks failed:\n" + failure_text(failed))
    return [o.value for o in outcomes]


def failure_text(failed: Sequence[RankOutcome]) -> str:
    """Each failed rank as a headed block: its traceback, or why it was lost."""
    return "\n".join(
        f"--- rank {o.rank} raised:\n{o.traceback.rstrip()}"
        if o.status == "raised"
        else f"--- rank {o.rank} {o.message}"
        for o in failed
    )


def _collect(
    processes: Sequence[BaseProcess], results: Queue[tuple[int, str, bytes]], timeout_s: float
) -> tuple[dict[int, tuple[str, bytes]], set[int], bool]:
    """Wait for every rank's report; kill whatever still runs at the deadline (pulled in by a failure)."""
    reports: dict[int, tuple[str, bytes]] = {}
    deadline = time.monotonic() + timeout_s
    failed = False
    try:
        while len(reports) < len(processes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, data = results.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                if all(p.exitcode is not None for p in processes):
                    break  # a rank died without reporting; nothing more will come
                if not failed and any(p.exitcode not in (None, 0) for p in processes):
                    failed, deadline = True, min(deadline, time.monotonic() + GRACE_S)
                continue
            reports[rank] = (status, data)
            if status != "ok" and not failed:
                failed, deadline = True, min(deadline, time.monotonic() + GRACE_S)
    finally:
        killed = {rank for rank, p in enumerate(processes) if p.is_alive() and rank not in reports}
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(10)
    return reports, killed, not failed


def _outcome(
    rank: int,
    reports: dict[int, tuple[str, bytes]],
    process: BaseProcess,
    killed: bool,
    timed_out: bool,
    timeout_s: float,
) -> RankOutcome:
    """How `rank` ended, from `reports` (by rank, in the order they arrived)."""
    if rank in reports:
        status, data = reports[rank]
        reported = list(reports).index(rank)
        if status == "ok":
            return RankOutcome(rank=rank, status="ok", value=pickle.loads(data), reported=reported)
        exc_type, message, text = pickle.loads(data)
        return RankOutcome(
            rank=rank, status="raised", exc_type=exc_type, message=message, traceback=text, reported=reported
        )
    if killed and timed_out:
        why = f"hung and was killed: still running after the timeout of {timeout_s:g} s"
    elif killed:
        why = "hung and was killed after another rank failed (blocked in a collective with it)"
    elif process.exitcode is not None and process.exitcode < 0:
        why = f"was killed by signal {-process.exitcode}"
    else:
        why = f"exited with code {process.exitcode} without reporting"
    return RankOutcome(rank=rank, status="lost", message=why)


def _rank_main(
    rank: int,
    world_size: int,
    payload: bytes,
    store_dir: str,
    port: int,
    init_group: bool,
    results: Queue[tuple[int, str, bytes]],
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    if init_group:
        # For frameworks that read the launcher's variables; the group itself is joined by file store.
        os.environ.update(launcher_variables(rank, world_size, port))
    try:
        try:
            fn, args = pickle.loads(payload)
        except Exception as exc:  # noqa: BLE001  an import error in the user's module, most often
            raise NotSendableError(
                f"rank {rank} could not load the function to run ({type(exc).__name__}: {exc}); it must be "
                "defined at module level in a module the rank processes can import: a package, or a test "
                "file collected by pytest's default --import-mode=prepend (not importlib)"
            ) from None
        import torch

        torch.set_num_threads(1)  # a few cores shared by all ranks: intra-op threads would only fight
        # FSDP2 warns about every module that returns a view; a rank's step does not modify outputs in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        if init_group:
            import torch.distributed as dist

            init_method = "file://" + os.path.join(store_dir, "store")
            timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
            dist.init_process_group(
                "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
            )
        value = fn(rank, world_size, *args)
        _leave_group()
        # Plain pickle: tensors travel by value, not as shared memory that dies with this process.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001  the parent reports it; a rank must never die silently
        kind = type(exc)
        text = "".join(traceback.format_exception(kind, exc, _from_user_code(exc.__traceback__)))
        raised = (f"{kind.__module__}.{kind.__qualname__}", str(exc), text)
        results.put((rank, "raised", pickle.dumps(raised)))
        # Sent before the group's sockets close: the rank that failed first reports first, ahead of
        # the peers whose collectives fail with it.
        results.close()
        results.join_thread()
        _leave_group()


def _from_user_code(tb: TracebackType | None) -> TracebackType | None:
    """The traceback without its leading frames in the launcher and the test helpers that call it."""
    while (
        tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename.startswith(_OWN_FRAMES)
    ):
        tb = tb.tb_next
    return tb


_OWN_FRAMES = (os.path.abspath(__file__), os.path.join(os.path.dirname(os.path.abspath(__file__)), "testing"))


def _leave_group() -> None:
    """Destroy this process's group, when it joined one."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()
