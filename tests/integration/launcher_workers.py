"""Workers for the launcher's own tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import time


def rank_and_world(rank: int, world_size: int) -> tuple[int, int, int]:
    import torch.distributed as dist

    return rank, world_size, dist.get_world_size()


def one_rank_raises(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.barrier()  # both ranks past joining the group: under load rank 0 could still be connecting
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(600)  # the surviving rank hangs as if blocked in a collective with the failed one
