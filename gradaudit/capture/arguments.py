"""Checking what the training code passed to audit_step, reading numbers out of what it returned, and
`CallRecord`, one clip call as the capture and the guard record it."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..dumpfile.schema import MAX_INT
from ..errors import CaptureError
from ..model import ClipCall


def rank_and_world_size() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env_world = os.environ.get("WORLD_SIZE", "1")
    if env_world.isdigit() and int(env_world) > 1:
        raise CaptureError(
            f"WORLD_SIZE is {env_world} but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() before gradaudit.audit_step (or unset WORLD_SIZE for one process)"
        )
    return 0, 1


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_INT:
        raise CaptureError(
            f"step must be a non-negative int below 2**63 (the optimizer step number), got {step!r}"
        )
    return step


def check_run_id(run_id: Any) -> str | None:
    """An integer job id is meant as its decimal string; anything else but a string is a mistake."""
    if run_id is None or isinstance(run_id, str):
        return run_id
    if isinstance(run_id, int) and not isinstance(run_id, bool):
        return str(run_id)
    raise CaptureError(
        f"run_id must be a string (or an integer job id), got {type(run_id).__name__} {run_id!r}"
    )


def check_tokens(tokens: Any) -> int | None:
    """A token count: a whole number from 0 to 2**63 - 1, as an int, a float or a one-element tensor."""
    if tokens is None:
        return None
    number = opt_float(tokens)
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        count = tokens
    elif number is not None and math.isfinite(number) and number == int(number):
        count = int(number)
    else:
        raise CaptureError(f"tokens must be a whole number of tokens, got {_shown(tokens)}")
    if not 0 <= count <= MAX_INT:
        raise CaptureError(f"tokens must be between 0 and 2**63 - 1, got {_shown(tokens)}")
    return count


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_max_norm(max_norm: Any) -> float:
    if max_norm is None:
        raise CaptureError(
            "audit_step needs max_norm=, the clipping threshold your training uses (e.g. max_norm=1.0)"
        )
    value = opt_float(max_norm)
    if value is None or not (value > 0 and math.isfinite(value)):
        raise CaptureError(
            f"max_norm must be a positive finite number (the clipping threshold), got {max_norm!r}"
        )
    return value


def check_norm_type(norm_type: Any) -> float:
    from ..norms import check_norm_type as valid_norm_type  # the reader's rule too

    try:
        return valid_norm_type(norm_type)
    except ValueError:
        raise CaptureError(
            f"norm_type must be positive or 'inf' (as in clip_grad_norm_), got {norm_type!r}"
        ) from None


def norm_results(result: Any) -> tuple[Any, Any]:
    """(the norm `fn` returned, and for a DTensor its local value that .to_local().item() would log)."""
    from .dtensor import is_dtensor

    if is_dtensor(result):
        # Every rank is inside the same clip call and holds this DTensor, so its collective is safe.
        return result.full_tensor(), result.to_local()
    return result, None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CallRecord:
    """One clip call as recorded while it ran (by audit_step, and by the guard on a checked step). Its
    numbers stay as the call left them, tensors on their device, and are read only when the dump or the
    guard's row is built, so that recording a call adds no device synchronisation to the step."""

    reported: Any = None
    """What the call returned (a tensor, a number or None); for a DTensor, its full tensor."""
    reported_local: Any = None
    """For a DTensor result: its local tensor, the value a careless `.item()` would log."""
    max_norm: Any = None
    """The `max_norm` argument the call was given (or its default), None when it names none."""
    norm_type: Any = None
    """The `norm_type` argument the call was given (or its default), None when it names none."""
    clip_value: Any = None
    """For `clip_grad_value_`: the value it clamped to."""
    unscaled: bool | None = None
    """Whether GradScaler.unscale_ had run before this call; None without a scaler (or not read)."""
    loss_scale: float | None = None
    """The scaler's loss scale before this call; None without a scaler (or not read)."""
    terms: Any = None
    """The guard's: per ownership group, sum |g|^p of the gradient just before the call."""
    before: Any = None
    """The guard's: its sample of gradient elements just before the call."""
    sampled: Any = ()
    """The guard's: which elements `before` holds, sampled again after the call."""
    coef: Any = None
    """The coefficient the call applied where an integration measured it (the guard's `applied`); None:
    the guard measures it at the optimizer step from `before` and the same elements then."""

    @classmethod
    def of(
        cls,
        fn: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        norms: tuple[Any, Any] | None,
        **measured: Any,
    ) -> CallRecord:
        """The call `fn(*args, **kwargs)` that returned `norms` (`norm_results` of its result; None:
        unread), with what the recorder measured around it (the other fields)."""
        reported, reported_local = (None, None) if norms is None else norms
        return cls(
            reported=reported,
            reported_local=reported_local,
            max_norm=call_argument(fn, args, kwargs, "max_norm"),
            norm_type=call_argument(fn, args, kwargs, "norm_type"),
            **measured,
        )

    def clip_call(self) -> ClipCall:
        """The call as the dump records it (reads its numbers: a device synchronisation)."""
        return ClipCall(
            reported_norm=opt_float(self.reported),
            reported_local_norm=opt_float(self.reported_local),
            max_norm=opt_float(self.max_norm),
            norm_type=opt_float(self.norm_type),
            unscaled=self.unscaled,
            loss_scale=self.loss_scale,
            clip_value=opt_float(self.clip_value),
        )


def clips_nothing(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a clip call passes max_norm=inf: `clip_grad_norm_(params, float("inf"))` is the common
    way to read the total norm without clipping, a measurement, not a clip."""
    max_norm = call_argument(fn, args, kwargs, "max_norm")
    try:
        return max_norm is not None and not isinstance(max_norm, bool) and float(max_norm) == math.inf
    except (TypeError, ValueError, RuntimeError):
        return False


def call_argument(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], name: str) -> Any:
    """The value a call `fn(*args, **kwargs)` passes for parameter `name` (its default when not
    passed), else None (no such parameter, or a signature that cannot be read)."""
    try:
        found = _parameter(fn, name)
    except TypeError:  # an unhashable callable: read its signature every time
        found = _parameter.__wrapped__(fn, name)
    if found is None:
        return None
    position, default = found
    if name in kwargs:
        return kwargs[name]
    if position is not None and position < len(args):
        return args[position]
    return default


@functools.lru_cache(maxsize=256)
def _parameter(fn: Callable[..., Any], name: str) -> tuple[int | None, Any] | None:
    """(its position when it may be passed positionally, its default or None) of parameter `name` of
    `fn`, read once per function (a clip call on every step binds no signature); None: no such one."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    for position, parameter in enumerate(parameters):
        if parameter.name == name and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            default = None if parameter.default is inspect.Parameter.empty else parameter.default
            return (position if parameter.kind in positional else None), default
    return None


def opt_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        if hasattr(value, "numel") and value.numel() != 1:
            return None
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None
