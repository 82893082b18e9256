"""HF `Trainer`: the guard as one callback; every optimizer step's clipping is checked while it trains.

    trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), ...)
    trainer.add_callback(GuardCallback("audit"))

The guard is attached when training begins (to the model and the torch optimizer behind the Trainer's)
and removed when it ends. It sees the Trainer's own clip (`accelerator.clip_grad_norm_`) and any clip
call of the user's code (a `training_step` override clipping each micro-batch is GA501).

Each of the Trainer's training log calls gets the logged step's
`TrendLine.metrics(prefix="gradaudit_")` beside its loss and `grad_norm`: `gradaudit_anomaly`,
`gradaudit_true_norm` and `gradaudit_reported_over_true` (that `grad_norm` over the true norm), at
`state.global_step`, the guard's number of the step; nothing for a step not checked (the step captured
in full after an anomaly, steps between `every=`). They reach `state.log_history` and every callback of
the call, TensorBoard's and W&B's included (the callback moves itself to the front of the Trainer's
callbacks when training begins, since the reporting ones are added before any of the user's). A step
whose clipping is wrong and that the Trainer does not log (`logging_steps`) is logged all the same once
the Trainer is done with it (at the next step's begin, or at the end of training): its values alone,
appended to `state.log_history` and handed to each callback's `on_log` as `Trainer.log` does (no loss:
the Trainer's own log call would gather it across ranks), so that an alert on `gradaudit_anomaly` fires
whatever the logging interval. On GPU the verdict of the step logged is read at its log call, where the
Trainer syncs with the device for its loss anyway; an anomaly of a step the Trainer does not log is read
only at the next step, and then not logged (it is in the warning and the trend). With fp16 the guard
takes Accelerate's GradScaler from the Trainer's optimizer (see `accelerate_guard`).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..live.guard import GuardCallbackOptions

PREFIX = "gradaudit_"


class GuardCallback(GuardCallbackOptions, TrainerCallback):
    """`gradaudit.guard` for an HF Trainer: GuardCallback(out_dir, max_norm=None, **guard_kwargs),
    keywords going to the guard (every, on_anomaly, ...). `max_norm` defaults to
    `TrainingArguments.max_grad_norm`."""

    _callbacks: tuple[list[Any], ...] = ()
    """The Trainer's list of callbacks (this one first), which a step's anomaly is handed to when the
    Trainer does not log that step."""
    _logged_step: int | None = None
    """The step whose values went out last."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._callbacks = self._log_first()
        self._logged_step = None
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

    def _log_first(self) -> tuple[list[Any], ...]:
        """Put this callback first in the Trainer's CallbackHandler list (the list that holds it and a
        DefaultFlowCallback), so that each on_log hands its values to the reporting callbacks too; that
        list is returned. The handler is iterating it (on_train_begin): moving an earlier position to the
        front keeps every later callback's position, so each is still called once."""
        import gc

        from transformers.trainer_callback import DefaultFlowCallback

        lists = []
        for holder in gc.get_referrers(self):
            if isinstance(holder, list) and any(isinstance(c, DefaultFlowCallback) for c in holder):
                holder.remove(self)
                holder.insert(0, self)
                lists.append(holder)
        return tuple(lists)

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or "loss" not in logs or self._logged_step == state.global_step:
            return  # not the log of a training step (the final summary, an evaluation), or logged already
        # the step just logged, or nothing (a step captured in full is not checked): never an older one
        line = None if self.guard is None else self.guard.line_of(state.global_step)
        if line is None:
            return
        logged_norm = logs.get("grad_norm")
        # reported/true of the grad_norm beside it (the Trainer's clip: the step's last clip call)
        reported = float(logged_norm) if isinstance(logged_norm, int | float) else None
        values = line.metrics(prefix=PREFIX, reported_norm=reported)
        if not values:
            return
        self._logged_step = state.global_step
        logs.update(values)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step and values.keys().isdisjoint(history[-1]):
            history[-1].update(values)  # Trainer.log appended a copy of the logs before calling on_log

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._log_anomaly(args, state, control, kwargs)  # of the step before, now that it is done

    def _log_anomaly(self, args: Any, state: Any, control: Any, kwargs: dict[str, Any]) -> None:
        """The values of the last step, if its clipping was wrong and the Trainer did not log it, as
        Trainer.log would: appended to state.log_history and handed to every other callback's on_log."""
        step = state.global_step
        line = None if self.guard is None else self.guard.line_of(step, read=False)
        if line is None or line.ok or self._logged_step == step:
            return
        self._logged_step = step
        values = line.metrics(prefix=PREFIX)
        state.log_history.append({**values, "step": step})
        for callback in (c for callbacks in self._callbacks for c in callbacks):
            if callback is not self:
                callback.on_log(args, state, control, logs=dict(values), **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.remove()  # kept: its anomalies, dumps and last line stay readable
            self._log_anomaly(args, state, control, kwargs)
