"""Process-wide interception of the known clip functions, so that every clip call made while an audit
is open is recorded, whoever makes it (a framework's loop, a hook, a `training_step` override).

    handle = install(route)   # route(call) runs the call and returns exactly what it returned
    ...                       # every call of a known clip function now goes through route
    handle.remove()           # the original functions are back once the last handle is removed

The functions are replaced where callers look them up: torch's `clip_grad_norm_`,
`clip_grads_with_norm_` (also as `clip_grad_norm_` looks it up in its own module, so a
`clip_grad_norm_` imported by name before the audit is seen too) and `clip_grad_value_`; and,
when their framework is already imported (never imported here), FSDP1's
`FullyShardedDataParallel.clip_grad_norm_`, Accelerate's `Accelerator.clip_grad_norm_` and
`clip_grad_value_`, and DeepSpeed's `runtime.utils.clip_grad_norm_`. A call made inside another
intercepted or recorded call (torch's clip inside Accelerate's) is not routed again: the outermost
call is the clip the training code made. The route decides what to record; the call's arguments,
result and gradients are the original function's. With several routes installed (a guard, and an
audit of the same step), each records the call, the newest outermost, and the call is made once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

ClipKind = Literal["norm", "apply", "value"]
"""What an intercepted function does: "norm" clips and returns the total norm; "apply" scales by a
total norm it is given (`clip_grads_with_norm_`); "value" clamps element-wise (`clip_grad_value_`)."""


@dataclass(frozen=True, kw_only=True)
class ClipTarget:
    """One function to intercept: `module`.`attribute` (an attribute path: "Class.method" for methods)."""

    module: str
    """The module that holds the function, as imported."""
    attribute: str
    """The attribute path inside `module` ("Class.method" for a method)."""
    kind: ClipKind
    """What the function does (see ClipKind)."""
    needs_import: bool = False
    """True for torch's own modules (imported here when installing); False for frameworks, which are
    intercepted only when the training process imported them already."""


def _torch(module: str, attribute: str, kind: ClipKind) -> ClipTarget:
    """A function of torch's own (its module is imported when installing)."""
    return ClipTarget(module=module, attribute=attribute, kind=kind, needs_import=True)


TARGETS: tuple[ClipTarget, ...] = (
    _torch("torch.nn.utils", "clip_grad_norm_", "norm"),
    _torch("torch.nn.utils.clip_grad", "clip_grad_norm_", "norm"),
    _torch("torch.nn.utils", "clip_grads_with_norm_", "apply"),
    _torch("torch.nn.utils.clip_grad", "_clip_grads_with_norm_", "apply"),
    _torch("torch.nn.utils", "clip_grad_value_", "value"),
    _torch("torch.nn.utils.clip_grad", "clip_grad_value_", "value"),
    ClipTarget(
        module="torch.distributed.fsdp.fully_sharded_data_parallel",
        attribute="FullyShardedDataParallel.clip_grad_norm_",
        kind="norm",
    ),
    ClipTarget(module="accelerate.accelerator", attribute="Accelerator.clip_grad_norm_", kind="norm"),
    ClipTarget(module="accelerate.accelerator", attribute="Accelerator.clip_grad_value_", kind="value"),
    ClipTarget(module="deepspeed.runtime.utils", attribute="clip_grad_norm_", kind="norm"),
)


@dataclass(frozen=True, kw_only=True)
class InterceptedCall:
    """One call of an intercepted function, not yet made."""

    target: ClipTarget
    """The intercepted function."""
    fn: Callable[..., Any]
    """The original function (for a method: the function, `self` being the first of `args`)."""
    args: tuple[Any, ...]
    """The positional arguments, as the caller passed them."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """The keyword arguments, as the caller passed them."""
    make: Callable[[], Any] | None = field(default=None, compare=False, repr=False)
    """What making the call runs: the original function, or the call through the routes installed
    before this one (None: the function)."""

    def __call__(self) -> Any:
        """Make the call; its result, unchanged."""
        if self.make is not None:
            return self.make()
        return self.fn(*self.args, **self.kwargs)

    def argument(self, name: str) -> Any:
        """The value the call passes for parameter `name` (its default when not passed), else None."""
        from .arguments import call_argument

        return call_argument(self.fn, self.args, self.kwargs, name)

    def reported_norm(self, result: Any) -> Any:
        """The total norm the call clipped with: what it returned, or for "apply" the norm it was given."""
        if self.target.kind == "norm":
            return result
        if self.target.kind == "apply":
            return self.argument("total_norm")
        return None


Route = Callable[[InterceptedCall], Any]
"""Runs the call (once) and returns its result unchanged; records whatever it wants around it."""


class Handle:
    """One installed route; `remove()` is idempotent."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self._removed = False

    def remove(self) -> None:
        with _LOCK:
            if self._removed:
                return
            self._removed = True
            _ROUTES.remove(self)
            if not _ROUTES:
                _restore()


_LOCK = threading.RLock()
_ROUTES: list[Handle] = []
"""Installed routes, oldest first: a call goes through every one, the newest outermost, so that a guard
and an audit of the same step both record it."""
_PATCHED: list[tuple[Any, str, bool, Any, Any]] = []
"""(owner, name, whether the owner had its own attribute, the original, our wrapper) per patch."""
_DEPTH = threading.local()


def install(route: Route) -> Handle:
    """Route every call of the known clip functions (in any thread) to `route` until removed."""
    handle = Handle(route)
    with _LOCK:
        if not _ROUTES:
            _patch()
        _ROUTES.append(handle)
    return handle


def inside() -> bool:
    """Whether this thread is inside an intercepted or recorded clip call (see `outermost`)."""
    return bool(getattr(_DEPTH, "value", 0))


@contextlib.contextmanager
def outermost() -> Iterator[bool]:
    """Within this block, intercepted calls in this thread are not routed (they are part of a call
    being recorded); yields whether this block is itself the outermost one."""
    depth = getattr(_DEPTH, "value", 0)
    _DEPTH.value = depth + 1
    try:
        yield depth == 0
    finally:
        _DEPTH.value = depth


_RECORDED = ClipTarget(module="", attribute="recorded", kind="norm")
"""The target of a call its caller records itself (`audit.clip(fn, ...)`, `guard.clip(fn, ...)`)."""


def recorded(
    own: Handle | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    record: Callable[[], Any],
) -> Any:
    """A clip call that the route `own` records itself (`record()` makes it, once): made through the
    other routes installed too, newest outermost, so that a guard sees a clip call an audit of the
    same step records with `audit.clip`, and the other way round."""
    routes = [handle.route for handle in _ROUTES if handle is not own]
    return _through(routes, InterceptedCall(target=_RECORDED, fn=fn, args=args, kwargs=kwargs, make=record))


def _through(routes: list[Route], call: InterceptedCall) -> Any:
    """Make `call` through `routes`, the newest outermost: each makes it through the ones installed
    before it; with no route, the call itself."""
    for route in routes[:-1]:
        call = dataclasses.replace(call, make=functools.partial(route, call))
    with outermost():
        return routes[-1](call) if routes else call()


def _wrapper(target: ClipTarget, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def intercepted(*args: Any, **kwargs: Any) -> Any:
        routes = [handle.route for handle in _ROUTES]
        if not routes or inside():
            return original(*args, **kwargs)
        return _through(routes, InterceptedCall(target=target, fn=original, args=args, kwargs=kwargs))

    intercepted.__gradaudit_intercepted__ = True  # type: ignore[attr-defined]
    return intercepted


def _resolve(target: ClipTarget) -> tuple[Any, str] | None:
    """(the object holding the attribute, its last name), or None when not available."""
    module = sys.modules.get(target.module)
    if module is None and target.needs_import:
        try:
            module = importlib.import_module(target.module)
        except ImportError:
            return None
    if module is None:
        return None
    owner: Any = module
    *path, name = target.attribute.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    if not callable(getattr(owner, name, None)):
        return None
    return owner, name


def _patch() -> None:
    for target in TARGETS:
        found = _resolve(target)
        if found is None:
            continue
        owner, name = found
        own = vars(owner)
        original = own[name] if name in own else getattr(owner, name)
        if getattr(original, "__gradaudit_intercepted__", False):
            continue
        wrapper = _wrapper(target, original)
        _PATCHED.append((owner, name, name in own, original, wrapper))
        setattr(owner, name, wrapper)


def _restore() -> None:
    for owner, name, had_own, original, wrapper in reversed(_PATCHED):
        if vars(owner).get(name) is not wrapper:
            continue  # patched again over ours by someone else: theirs stays
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)
    _PATCHED.clear()
