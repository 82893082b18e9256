"""Accelerate: the guard in one line after `prepare`; every optimizer step's clipping is checked.

    accelerator = Accelerator(gradient_accumulation_steps=4, log_with="tensorboard")
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerate_guard(accelerator, model, optimizer, "audit", max_norm=1.0)   # the one added line
    # ... the loop of gradaudit.integrations.accelerate, unchanged

The guard hooks the torch optimizer behind the prepared one (it steps only when the gradients are
synced, so micro-batches are counted into their optimizer step) and sees every clip call:
`accelerator.clip_grad_norm_` and any torch clip of the user's code, so a clip on a micro-batch that
does not sync is GA501. Each checked step's `TrendLine.metrics()` (`gradaudit/anomaly`,
`gradaudit/true_norm`, `gradaudit/reported_over_true`) goes to the Accelerator's trackers
(`accelerator.log`, main process only) at the optimizer step's number, the guard's; nothing for a step
not checked (the step captured in full after an anomaly, steps between `every=`). With fp16 the guard
takes the Accelerator's GradScaler: `accelerator.clip_grad_norm_` unscales the gradients before its norm, and the
guard divides the loss scale out of what it measured before the call; a torch clip that skips that
unscale is GA502, a step the scaler skips for inf gradients is written to the trend as skipped.
"""

from __future__ import annotations

import os
from typing import Any

from ..live.guard import Guard
from ..live.trend import TrendLine


def accelerate_guard(
    accelerator: Any,
    model: Any,
    optimizer: Any,
    out_dir: str | os.PathLike[str],
    *,
    max_norm: float,
    **guard_kwargs: Any,
) -> Guard:
    """`gradaudit.guard` on a prepared model and optimizer, logging through `accelerator.log`; other
    keywords go to the guard (every, on_anomaly, on_verdict, ...). `guard.remove()` stops it."""
    return Guard(
        model,
        max_norm=max_norm,
        optimizer=optimizer,
        out_dir=out_dir,
        **{
            "scaler": getattr(accelerator, "scaler", None),
            **guard_kwargs,
            "on_verdict": logging_to(accelerator.log, guard_kwargs.get("on_verdict")),
        },
    )


def logging_to(log: Any, also: Any = None) -> Any:
    """An on_verdict that logs each checked step's `TrendLine.metrics()` as log(values, step=...)."""

    def on_verdict(line: TrendLine) -> None:
        values = line.metrics()
        if values:
            log(values, step=line.step)
        if also is not None:
            also(line)

    return on_verdict
