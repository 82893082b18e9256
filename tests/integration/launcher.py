"""Run a function on N gloo ranks on CPU for integration tests: gradaudit.localranks, the launcher of
the public test helpers and the demo.

    results = run_ranks(my_worker, world_size=4, args=(out_dir,))

`my_worker(rank, world_size, *args)` must be a module-level function (it is pickled by reference).
Each rank is spawned from scratch, so it sees the environment the test set (monkeypatch.setenv).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gradaudit import localranks
from gradaudit.localranks import RankFailure

__all__ = ["DEFAULT_TIMEOUT_S", "RankFailure", "run_ranks"]

DEFAULT_TIMEOUT_S = 90.0


def run_ranks(
    fn: Callable, world_size: int, args: Sequence[Any] = (), *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the values in rank order."""
    return localranks.run_ranks(fn, world_size, args, timeout_s=timeout_s, start_method="spawn")
