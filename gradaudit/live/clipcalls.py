"""Every clip call in the process, routed through one function while installed (the guard's view of
the clip calls; the interface the capture's interception module will provide)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

Around = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""around(fn, args, kwargs) -> what fn(*args, **kwargs) returns: called instead of each clip call."""


def _targets() -> list[tuple[Any, str]]:
    """(owner, attribute) of every clip function this module routes: torch's own and FSDP1's method."""
    import torch.nn.utils
    import torch.nn.utils.clip_grad

    found: list[tuple[Any, str]] = [
        (torch.nn.utils, "clip_grad_norm_"),
        (torch.nn.utils.clip_grad, "clip_grad_norm_"),
    ]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return found
    found.append((FullyShardedDataParallel, "clip_grad_norm_"))
    return found


class ClipWatch:
    """While installed, each call of a known clip function goes through `around` once (a clip call
    made from inside another, e.g. FSDP1's method calling torch's function, is not counted twice)."""

    def __init__(self, around: Around) -> None:
        self._around = around
        self._patched: list[tuple[Any, str, Any]] = []
        self._depth = 0

    @property
    def installed(self) -> bool:
        return bool(self._patched)

    def install(self) -> None:
        if self._patched:
            return
        originals: dict[int, Any] = {}
        for owner, name in _targets():
            original = vars(owner).get(name)
            if original is None:
                continue
            wrapped = originals.setdefault(id(original), self._wrap(original))
            self._patched.append((owner, name, original))
            setattr(owner, name, wrapped)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def _wrap(self, original: Any) -> Any:
        watch = self

        @functools.wraps(original)
        def clip(*args: Any, **kwargs: Any) -> Any:
            if watch._depth:
                return original(*args, **kwargs)
            watch._depth += 1
            try:
                return watch._around(original, args, kwargs)
            finally:
                watch._depth -= 1

        return clip
