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

Where torch computes the total from those norms in its own function (`_get_total_norm`, torch 2.6 on),
that function asked for this pass returns the guard's total instead: `vector_norm` of the norms the
guard stacked, in the same order, which is what torch would stack. That saves torch's stack of the
norms too, a tensor op per gradient (at 1,000 gradients, two thirds of what the guard adds to a step).
It answers only where torch's own would take every norm from one `_foreach_norm` and stack them in
the guard's order: plain tensors of one dtype on a device with foreach kernels, `foreach` not False,
`error_if_nonfinite` off.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _foreach_utils


@dataclass(frozen=True)
class NormPass:
    """One `torch._foreach_norm(tensors, ord)`, what it returned, and those norms stacked."""

    tensors: list[Any]
    ord: float
    norms: tuple[Any, ...]
    stacked: Any = None

    def answers(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether `_foreach_norm(*args, **kwargs)` asks for this pass again."""
        if kwargs or len(args) != 2:
            return False
        tensors, ord = args
        return self._same(tensors, ord)

    def answers_total(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether torch's `_get_total_norm(*args, **kwargs)` would stack exactly these norms, in this
        order, and nothing else happens in it (see the module's docstring)."""
        names = ("tensors", "norm_type", "error_if_nonfinite", "foreach")
        if self.stacked is None or len(args) > len(names) or not set(kwargs) <= set(names[len(args) :]):
            return False
        asked = {"norm_type": 2.0, "error_if_nonfinite": False, "foreach": None} | dict(
            zip(names, args, strict=False)
        )
        asked |= kwargs
        tensors, foreach = asked["tensors"], asked["foreach"]
        if asked["error_if_nonfinite"] or foreach is False or not isinstance(tensors, list) or not tensors:
            return False
        if not self._same(tensors, float(asked["norm_type"])):
            return False
        one_kind = set(map(type, tensors)) == {torch.Tensor} and len(set(map(_DTYPE, tensors))) == 1
        return one_kind and _has_foreach_kernels(tensors[0].device)

    def _same(self, tensors: Any, ord: Any) -> bool:
        return (
            ord == self.ord
            and len(tensors) == len(self.tensors)
            and all(map(operator.is_, tensors, self.tensors))
        )


_DTYPE = operator.attrgetter("dtype")


def _has_foreach_kernels(device: Any) -> bool:
    """Whether torch's clip takes the norms on `device` with `_foreach_norm` (else one by one)."""
    supported = getattr(_foreach_utils, "_device_has_foreach_support", None)
    return bool(supported is not None and supported(device))


@contextlib.contextmanager
def lent(done: NormPass | None) -> Iterator[None]:
    """Within this block, `torch._foreach_norm` asked for `done` again returns its norms, and torch's
    `_get_total_norm` asked for their total returns it (see above)."""
    if done is None:
        yield
        return

    real = torch._foreach_norm
    clip_grad = sys.modules.get("torch.nn.utils.clip_grad")
    real_total = getattr(clip_grad, "_get_total_norm", None)

    def foreach_norm(*args: Any, **kwargs: Any) -> Any:
        return done.norms if _asks(done.answers, args, kwargs) else real(*args, **kwargs)

    def total_norm(*args: Any, **kwargs: Any) -> Any:
        assert real_total is not None
        if not _asks(done.answers_total, args, kwargs):
            return real_total(*args, **kwargs)
        with torch.no_grad():
            return torch.linalg.vector_norm(done.stacked, done.ord)

    torch._foreach_norm = foreach_norm
    if real_total is not None:
        clip_grad._get_total_norm = total_norm  # type: ignore[union-attr]
    try:
        yield
    finally:
        if torch._foreach_norm is foreach_norm:
            torch._foreach_norm = real
        if real_total is not None and getattr(clip_grad, "_get_total_norm", None) is total_norm:
            clip_grad._get_total_norm = real_total  # type: ignore[union-attr]


def _asks(answers: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        return bool(answers(args, kwargs))
    except Exception:  # noqa: BLE001  anything unexpected: torch's own
        return False
