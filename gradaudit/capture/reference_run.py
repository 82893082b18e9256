"""Writing the unsharded reference of a sharded step from the same training function, in one process.

    gradaudit.run_reference(train_step, "audit/reference", batch=global_batch)

runs `train_step(...)` once as rank 0 of a one-process gloo group (CPU), so that the function's own
`torch.distributed` calls, FSDP2 `fully_shard`, DDP and `init_device_mesh` work unchanged and see world
size 1: its `gradaudit.audit_step(...)` then writes the reference dump.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from ..errors import UsageError

T = TypeVar("T")


def run_reference(fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
    """Call `fn(*args, **kwargs)` as the only rank of a fresh one-process gloo group and return its result.

    The function must build the model from the same seed as the sharded run, take the whole global
    batch (the ranks' batches concatenated in rank order: a function that slices its share by rank and
    world size does this by itself at world size 1), reduce the loss the same way over it (a mean over
    the global batch, when each rank averages its own equal share and the data-parallel reduction
    averages the ranks), and record with the same `step=`, `max_norm=`, `norm_type=` and optimizer.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise UsageError(
            "run_reference() starts its own one-process group, but torch.distributed is already initialized "
            "here; call it from a fresh process (not from inside a rank of the sharded run)"
        )
    with _single_rank_environment():
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            return fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def launcher_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for rank `rank` of `world_size` on this host (frameworks read them)."""
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **{k: str(v) for k, v in ranks.items()}}


@contextmanager
def _single_rank_environment() -> Iterator[None]:
    variables = launcher_variables(0, 1, free_port())
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
