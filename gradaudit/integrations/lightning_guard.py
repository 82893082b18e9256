"""Lightning: the guard as one callback; every optimizer step's clipping is checked while `fit` runs.

    trainer = L.Trainer(strategy="ddp", gradient_clip_val=1.0, callbacks=[GuardCallback("audit")])

The guard is attached when training starts (to the LightningModule and the Trainer's optimizer) and
removed when it ends. It sees Lightning's own clip (`torch.nn.utils.clip_grad_norm_`) and any clip call
of the user's hooks (`on_after_backward`, `configure_gradient_clipping`, `training_step`), so a clip
per micro-batch under `accumulate_grad_batches` is GA501.

Each checked step's `TrendLine.metrics()` (`gradaudit/anomaly`, `gradaudit/true_norm`,
`gradaudit/reported_over_true`) goes to the Trainer's loggers at `trainer.global_step`, the guard's
number of the step (Lightning's own `self.log` would log it at `global_step - 1`, the count of batches
that stepped before it): on the steps Lightning logs (`log_every_n_steps`), and on every step whose
clipping is wrong, so that an alert on `gradaudit/anomaly` fires whatever the logging interval. Nothing
for a step not checked (the step captured in full after an anomaly, steps between `every=`). The same
values are in `trainer.callback_metrics` (as `self.log(..., logger=False)` puts them) for callbacks
that monitor them. On GPU, where the verdict is read one step late, the verdict of a step Lightning
logs is read at that step, where it syncs for its own metrics anyway; an anomaly of another step is
logged at its own step once read, at the next.
With `precision="16-mixed"` the guard takes the precision plugin's GradScaler: Lightning unscales before
its clip, a clip of the user's hooks before that sees the gradients still multiplied by the loss scale
(GA502), and a step the scaler skips for inf gradients is written to the trend as skipped.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.callbacks import Callback

from ..live.guard import GuardCallbackOptions
from ..live.trend import TrendLine


class GuardCallback(GuardCallbackOptions, Callback):
    """`gradaudit.guard` for a Lightning Trainer: GuardCallback(out_dir, max_norm=None, **guard_kwargs),
    keywords going to the guard (every, on_anomaly, on_verdict, ...). `max_norm` defaults to the
    Trainer's `gradient_clip_val`."""

    def __init__(
        self, out_dir: str | os.PathLike[str], *, max_norm: float | None = None, **guard_kwargs: Any
    ) -> None:
        self._on_verdict = guard_kwargs.pop("on_verdict", None)
        super().__init__(out_dir, max_norm=max_norm, **guard_kwargs)
        self._unlogged: list[TrendLine] = []
        """The lines the guard judged since the last batch ended, in order."""
        self._step_seen: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._unlogged, self._step_seen = [], None
        self.attach(
            pl_module,
            trainer.optimizers[0],
            "Trainer(gradient_clip_val=...)",
            trainer.gradient_clip_val,
            first_step=trainer.global_step + 1,
            # precision="16-mixed": the precision plugin's GradScaler (None otherwise)
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            on_verdict=self._judged,
        )

    def _judged(self, line: TrendLine) -> None:
        self._unlogged.append(line)
        if self._on_verdict is not None:
            self._on_verdict(line)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, guard = trainer.global_step, self.guard
        if guard is None or step == self._step_seen:  # another micro-batch of a step already seen
            return
        self._step_seen = step
        logs = bool(trainer.log_every_n_steps) and step % trainer.log_every_n_steps == 0
        # this step's line, never an older one; on GPU (late=True) read from the device only on a step
        # Lightning logs, where it syncs for its own metrics anyway
        line = guard.line_of(step, read=logs)
        if line is not None:
            for name, value in line.metrics().items():
                pl_module.log(name, value, logger=False, rank_zero_only=True)
        self._log(trainer, step if logs else None)

    def _log(self, trainer: Any, logged_step: int | None) -> None:
        """Hand the loggers the lines judged since the last call: that of `logged_step`, and any anomaly."""
        lines, self._unlogged = self._unlogged, []
        if not trainer.is_global_zero:
            return
        for line in lines:
            values = line.metrics() if line.step == logged_step or not line.ok else {}
            for logger in trainer.loggers if values else ():
                logger.log_metrics(values, step=line.step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is not None:
            self.guard.remove()  # kept: its anomalies, dumps and last line stay readable
            self._log(trainer, None)  # the last step's anomaly, read one step late

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.drop_pending()  # the training failed: its exception matters, not the last verdict
            self.guard.remove()
