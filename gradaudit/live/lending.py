"""The guard's norm pass, lent to the clip call it measured. torch's `clip_grad_norm_` takes the norm of
each gradient with one `torch._foreach_norm` right after the guard took the same norms of the same
tensors the same way. While that call runs, a `_foreach_norm` over exactly the guard's tensors (the same
objects, in the same order), of the same order of norm, returns the guard's results: the same kernel on
the same numbers gives the same bits, so the clip computes what it would have, without a second pass.
Any other call goes through to torch.

The numbers are the same because nothing writes the gradients between the guard's pass and the clip's:
the guard lends only to torch's own clip call, entered right after its pass, which writes nothing
before its norm. A framework's clip may unscale the gradients first (Accelerate's, DeepSpeed's), and
version counters would not show it (GradScaler's unscale kernel, `.data` and collectives leave them as
they were), so those calls make their own pass.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NormPass:
    """One `torch._foreach_norm(tensors, ord)` and what it returned."""

    tensors: list[Any]
    ord: float
    norms: tuple[Any, ...]

    def answers(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether `_foreach_norm(*args, **kwargs)` asks for this pass again."""
        if kwargs or len(args) != 2:
            return False
        tensors, ord = args
        return (
            ord == self.ord
            and len(tensors) == len(self.tensors)
            and all(map(operator.is_, tensors, self.tensors))
        )


@contextlib.contextmanager
def lent(done: NormPass | None) -> Iterator[None]:
    """Within this block, `torch._foreach_norm` asked for `done` again returns its norms (see above)."""
    if done is None:
        yield
        return
    import torch

    real = torch._foreach_norm

    def foreach_norm(*args: Any, **kwargs: Any) -> Any:
        try:
            again = done.answers(args, kwargs)
        except Exception:  # noqa: BLE001  anything unexpected: torch's own pass
            again = False
        return done.norms if again else real(*args, **kwargs)

    torch._foreach_norm = foreach_norm
    try:
        yield
    finally:
        if torch._foreach_norm is foreach_norm:
            torch._foreach_norm = real
