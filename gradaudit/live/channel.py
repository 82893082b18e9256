"""The guard's own channel between ranks: a process group of its own, so that its collectives never pair
with the training's, and exchanges whose waits are bounded, so that a rank that does not take part costs
the others a bounded wait, never a hang.

The groups are gloo on the host whatever the training's backend (no second NCCL communicator and its
device memory; a vector on a GPU is copied to the host one step late, see Guard). Each kind of exchange
has a group of its own (the step's sum, the rows gathered for a step it does not settle, the sizes and
the bytes of an ownership exchange, the per-parameter sums of a spike), so every collective of a group has one size on every rank: a rank
that leaves between two exchanges of one step can leave the others waiting for it, never pair one of
their collectives with another size (gloo aborts the process on that). Every exchange is
posted asynchronously and waited for with a timeout: a wait that runs out leaves the exchange posted
(gloo completes it in the background when the other ranks post theirs), so the caller can read it
later. The group's own timeout, much longer, ends an exchange that no other rank ever posts.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WAIT_S = 10.0
"""How long a rank waits for the others' part of an exchange before it reads it later instead."""
GROUP_TIMEOUT_S = 600.0
"""When gloo itself gives up an exchange no other rank posts (it then frees its worker thread)."""


class ChannelError(Exception):
    """An exchange failed (a peer's group closed, or gloo gave it up): this rank's guard must stop."""


@dataclass(eq=False)
class Exchange:
    """One posted exchange of a fixed-size vector (an all-reduce that sums, or an all-gather): what was
    sent, where the result lands, its work."""

    step: int
    """The guard's step the vector belongs to."""
    vector: Any
    """What this rank sent (on the host)."""
    gathered: Any
    work: Any = None
    """The asynchronous work (None: already complete, as in a world of one)."""
    waited: bool = False
    """A wait for it already ran out once (it is read later, or the others are gone)."""
    row: Any = None
    """Of a sum: this rank's row, gathered when the sum does not settle the step (see fastpath)."""


class Channel:
    """Posts and reads the guard's exchanges on its own process group (none in a world of one)."""

    KINDS = ("sum", "rows", "sizes", "bytes", "spike")

    def __init__(self, groups: dict[str, Any] | None, world_size: int, wait_s: float) -> None:
        self.groups, self.world_size, self.wait_s = groups, world_size, wait_s

    @classmethod
    def open(cls, world_size: int, wait_s: float = WAIT_S) -> Channel:
        """The channel of a world of `world_size` ranks; every rank must open it at the same point."""
        if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return cls(None, 1, wait_s)
        timeout = timedelta(seconds=max(GROUP_TIMEOUT_S, 4 * wait_s))
        return cls(
            {kind: dist.new_group(backend="gloo", timeout=timeout) for kind in cls.KINDS}, world_size, wait_s
        )

    def group(self, kind: str) -> Any:
        """The process group of one kind of exchange (None in a world of one)."""
        return None if self.groups is None else self.groups[kind]

    def post(self, step: int, vector: torch.Tensor, kind: str = "rows") -> Exchange:
        """All-gather `vector` (a 1-D host tensor, the same size on every rank) without waiting."""
        if self.groups is None:
            return Exchange(step=step, vector=vector, gathered=vector)
        gathered = torch.empty(self.world_size * vector.numel(), dtype=vector.dtype)
        # all_gather_single is all_gather_into_tensor's newer name (the old one warns from torch 2.13)
        gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather_single(gathered, vector, group=self.groups[kind], async_op=True)
        return Exchange(step=step, vector=vector, gathered=gathered, work=work)

    def post_sum(
        self, step: int, vector: torch.Tensor, row: torch.Tensor | None, kind: str = "sum"
    ) -> Exchange:
        """All-reduce (sum) `vector` in place (a 1-D float64 host tensor, the same size on every rank)
        without waiting; `row` is kept with it."""
        if self.groups is None:
            return Exchange(step=step, vector=vector, gathered=vector, row=row)
        work = dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=self.groups[kind], async_op=True)
        return Exchange(step=step, vector=vector, gathered=vector, work=work, row=row)

    def read(self, exchange: Exchange, wait_s: float | None = None) -> torch.Tensor | None:
        """The gathered vector, every rank's in rank order; None when the others have not posted theirs
        within `wait_s` (the exchange stays posted: read it again later). Raises ChannelError when the
        exchange failed."""
        if exchange.work is None:
            return exchange.gathered  # type: ignore[no-any-return]
        try:
            if not exchange.work.is_completed():
                exchange.work.wait(timeout=timedelta(seconds=self.wait_s if wait_s is None else wait_s))
            exchange.work.wait()  # complete by now: raises the exchange's own error, if it failed
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() and not exchange.work.is_completed():
                exchange.waited = True
                return None
            raise ChannelError(str(exc).splitlines()[0]) from exc
        exchange.work = None
        return exchange.gathered  # type: ignore[no-any-return]

    def exchange_bytes(self, mine: bytes, wait_s: float) -> list[bytes]:
        """Every rank's `mine`, in rank order: sizes first, then the padded bytes, each wait bounded by
        `wait_s`. Raises ChannelError when a rank does not take part in time."""
        if self.groups is None:
            return [mine]
        sizes = self._all(torch.tensor([float(len(mine))], dtype=torch.float64), wait_s, "sizes")
        longest = int(sizes.max())
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
        every = self._all(padded, wait_s, "bytes").reshape(self.world_size, longest)
        return [every[r, : int(sizes[r])].numpy().tobytes() for r in range(self.world_size)]

    def _all(self, vector: torch.Tensor, wait_s: float, kind: str) -> torch.Tensor:
        exchange = self.post(-1, vector, kind)
        gathered = self.read(exchange, wait_s)
        if gathered is None:
            raise ChannelError(f"a rank did not take part in the guard's exchange within {wait_s:g} s")
        return gathered
