"""HF `Trainer`: the guard as one callback; every optimizer step's clipping is checked while it trains.

    trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), ...)
    trainer.add_callback(GuardCallback("audit"))

The guard is attached when training begins (to the model and the torch optimizer behind the Trainer's)
and removed when it ends. It sees the Trainer's own clip (`accelerator.clip_grad_norm_`) and any clip
call of the user's code (a `training_step` override clipping each micro-batch is GA501). The true norm
of the latest checked step and its ratio to the reported norm are added to the Trainer's logs as
`gradaudit_true_norm` and `gradaudit_reported_over_true` (reporting integrations that run before this
callback log without them; `state.log_history` has them).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback

from ..live.guard import Guard


class GuardCallback(TrainerCallback):
    """`gradaudit.guard` for an HF Trainer; keywords go to the guard (every, on_anomaly, ...).
    `max_norm` defaults to `TrainingArguments.max_grad_norm`."""

    def __init__(
        self, out_dir: str | os.PathLike[str], *, max_norm: float | None = None, **guard_kwargs: Any
    ) -> None:
        self.out_dir = out_dir
        self.max_norm = max_norm
        self.guard_kwargs = guard_kwargs
        self.guard: Guard | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        max_norm = self.max_norm if self.max_norm is not None else args.max_grad_norm
        if not max_norm:
            from ..errors import CaptureError

            raise CaptureError(
                "GuardCallback needs the max_norm clipping should use: set TrainingArguments(max_grad_norm=...) "
                "or pass GuardCallback(..., max_norm=...)"
            )
        self.guard = Guard(
            kwargs["model"],
            max_norm=float(max_norm),
            optimizer=kwargs["optimizer"],
            out_dir=self.out_dir,
            first_step=state.global_step + 1,
            **self.guard_kwargs,
        )

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        line = None if self.guard is None else self.guard.last
        if logs is None or line is None or line.true_norm is None:
            return
        logs["gradaudit_true_norm"] = line.true_norm
        if line.reported_norm is not None and line.true_norm > 0:
            logs["gradaudit_reported_over_true"] = line.reported_norm / line.true_norm

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.remove()  # kept: its anomalies, dumps and last line stay readable
