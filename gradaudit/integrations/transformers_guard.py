"""HF `Trainer`: the guard as one callback; every optimizer step's clipping is checked while it trains.

    trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), ...)
    trainer.add_callback(GuardCallback("audit"))

The guard is attached when training begins (to the model and the torch optimizer behind the Trainer's)
and removed when it ends. It sees the Trainer's own clip (`accelerator.clip_grad_norm_`) and any clip
call of the user's code (a `training_step` override clipping each micro-batch is GA501). The true norm
of the step logged and its ratio to the reported norm are added to each of the Trainer's log calls,
beside its `grad_norm`, as `gradaudit_true_norm` and `gradaudit_reported_over_true` (that `grad_norm`
over the true norm; nothing for a
step not checked: one captured in full after an anomaly, or between every=): in `state.log_history`
and for every callback of the call, TensorBoard's and W&B's included (the callback moves itself to
the front of the Trainer's callbacks when training begins, since the reporting ones are added before
any of the user's). On GPU the verdict of the step logged is read at its log call, where the Trainer
syncs with the device for its loss anyway. With fp16 the guard takes Accelerate's GradScaler from the
Trainer's optimizer (see `accelerate_guard`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from transformers import TrainerCallback

from ..live.guard import GuardCallbackOptions


class GuardCallback(GuardCallbackOptions, TrainerCallback):
    """`gradaudit.guard` for an HF Trainer: GuardCallback(out_dir, max_norm=None, **guard_kwargs),
    keywords going to the guard (every, on_anomaly, ...). `max_norm` defaults to
    `TrainingArguments.max_grad_norm`."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._log_first()
        optimizer = kwargs["optimizer"]
        self.attach(
            kwargs["model"],
            optimizer,
            "TrainingArguments(max_grad_norm=...)",
            args.max_grad_norm,
            first_step=state.global_step + 1,
            # fp16: Accelerate's GradScaler, which its optimizer wrapper holds (None otherwise)
            scaler=getattr(optimizer, "scaler", None),
        )

    def _log_first(self) -> None:
        """Put this callback first in the Trainer's CallbackHandler list (the list that holds it and a
        DefaultFlowCallback), so that each on_log hands its values to the reporting callbacks too. The
        handler is iterating that list (on_train_begin): moving an earlier position to the front keeps
        every later callback's position, so each is still called once."""
        import gc

        from transformers.trainer_callback import DefaultFlowCallback

        for holder in gc.get_referrers(self):
            if isinstance(holder, list) and any(isinstance(c, DefaultFlowCallback) for c in holder):
                holder.remove(self)
                holder.insert(0, self)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        # the step just logged, or nothing (a step captured in full is not checked): never an older one
        line = None if self.guard is None else self.guard.line_of(state.global_step)
        if logs is None or line is None:
            return
        logged_norm = logs.get("grad_norm")
        if isinstance(logged_norm, int | float):  # reported/true of the grad_norm beside it, as torchtitan's
            line = replace(line, reported_norm=float(logged_norm))
        values = line.metrics(prefix="gradaudit_")
        if not values or logs is None:
            return
        logs.update(values)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step and values.keys().isdisjoint(history[-1]):
            history[-1].update(values)  # Trainer.log appended a copy of the logs before calling on_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.remove()  # kept: its anomalies, dumps and last line stay readable
