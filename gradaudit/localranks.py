"""Local CPU rank processes, shared by the demo and the test helpers: a free loopback port, the
multiprocessing context and what every rank process does first."""

from __future__ import annotations

import multiprocessing
import socket
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from multiprocessing.context import ForkServerContext, SpawnContext

StartMethod = Literal["forkserver", "spawn"]
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor"]
"""Imported once by the fork server, so that each rank starts in a fraction of a second, not seconds."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def process_context(start_method: StartMethod = "forkserver") -> ForkServerContext | SpawnContext:
    """The multiprocessing context for rank processes: a fork server that has imported torch already
    when the platform has one and `start_method` asks for it, else spawn."""
    if start_method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
        return context
    return multiprocessing.get_context("spawn")


def prepare_rank_process() -> None:
    """What every rank process does first: one intra-op thread, and FSDP2's view warning silenced."""
    import warnings

    import torch

    # A few cores shared by all ranks: intra-op threads would only fight each other.
    torch.set_num_threads(1)
    # FSDP2 warns about every module that returns a view; a rank's step does not modify outputs in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
