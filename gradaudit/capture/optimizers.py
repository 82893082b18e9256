"""Finding the torch.optim.Optimizer to hook behind the wrappers frameworks hand their users."""

from __future__ import annotations

from typing import Any

from ..warn import warn_once

_MAX_DEPTH = 8


def hookable_optimizer(optimizer: Any) -> Any:
    """The optimizer whose step hooks gradaudit can register, or None (with a warning) when there is none.

    Wrappers that expose the real optimizer as `.optimizer` (Accelerate's AcceleratedOptimizer, which is
    also what HF Trainer hands its callbacks; Lightning's LightningOptimizer) are unwrapped. An
    AcceleratedOptimizer subclasses torch.optim.Optimizer without initializing it, so a subclass is
    accepted only when its hook registries exist.
    """
    if optimizer is None:
        return None
    current = optimizer
    for _ in range(_MAX_DEPTH):
        inner = getattr(current, "optimizer", None)
        if inner is None or inner is current:
            break
        current = inner
    if _has_step_hooks(current):
        return current
    kind = type(optimizer).__module__ + "." + type(optimizer).__qualname__
    warn_once(
        f"optimizer:{kind}",
        f"gradaudit: optimizer= got a {kind}, which has no torch.optim step hooks and exposes no "
        "torch.optim.Optimizer as .optimizer; the parameters before and after the step are not recorded. "
        "Pass the torch.optim.Optimizer that it wraps instead.",
    )
    return None


def _has_step_hooks(optimizer: Any) -> bool:
    import torch

    return (
        isinstance(optimizer, torch.optim.Optimizer)
        and hasattr(optimizer, "_optimizer_step_pre_hooks")
        and hasattr(optimizer, "_optimizer_step_post_hooks")
    )
