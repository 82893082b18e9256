"""Lightning: the guard as one callback; every optimizer step's clipping is checked while `fit` runs.

    trainer = L.Trainer(strategy="ddp", gradient_clip_val=1.0, callbacks=[GuardCallback("audit")])

The guard is attached when training starts (to the LightningModule and the Trainer's optimizer) and
removed when it ends. It sees Lightning's own clip (`torch.nn.utils.clip_grad_norm_`) and any clip call
of the user's hooks (`on_after_backward`, `configure_gradient_clipping`, `training_step`), so a clip
per micro-batch under `accumulate_grad_batches` is GA501. The true norm and its ratio to the reported
one are logged through `pl_module.log` as `gradaudit/true_norm` and `gradaudit/reported_over_true`,
each step's own (nothing for a step not checked; on GPU, where the verdict is read one step late,
on the steps Lightning logs).
With `precision="16-mixed"` the guard takes the precision plugin's GradScaler: Lightning unscales before
its clip, a clip of the user's hooks before that sees the gradients still multiplied by the loss scale
(GA502), and a step the scaler skips for inf gradients is written to the trend as skipped.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

from ..live.guard import GuardCallbackOptions


class GuardCallback(GuardCallbackOptions, Callback):
    """`gradaudit.guard` for a Lightning Trainer: GuardCallback(out_dir, max_norm=None, **guard_kwargs),
    keywords going to the guard (every, on_anomaly, ...). `max_norm` defaults to the Trainer's
    `gradient_clip_val`."""

    _logged_step: int | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.attach(
            pl_module,
            trainer.optimizers[0],
            "Trainer(gradient_clip_val=...)",
            trainer.gradient_clip_val,
            first_step=trainer.global_step + 1,
            # precision="16-mixed": the precision plugin's GradScaler (None otherwise)
            scaler=getattr(trainer.precision_plugin, "scaler", None),
        )

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, guard = trainer.global_step, self.guard
        if guard is None or step == self._logged_step:
            return
        # this step's line, never an older one; on GPU (late=True) read from the device only on a step
        # Lightning logs, where it syncs for its own metrics anyway
        logs = bool(trainer.log_every_n_steps) and step % trainer.log_every_n_steps == 0
        line = guard.line_of(step, read=logs)
        if line is None:
            return
        self._logged_step = step
        for name, value in line.metrics().items():
            pl_module.log(name, value, rank_zero_only=True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.guard is not None:
            self.guard.remove()  # kept: its anomalies, dumps and last line stay readable

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.drop_pending()  # the training failed: its exception matters, not the last verdict
            self.guard.remove()
