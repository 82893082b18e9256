"""torchtitan: the guard in one line beside a torchtitan `Trainer`; every step's clipping is checked.

    trainer = Trainer(config)                          # torchtitan/train.py builds this
    TorchtitanGuard(trainer, "audit")                  # the one added line
    trainer.train()

The guard hooks `trainer.optimizers` (an OptimizersContainer, a hookable torch optimizer), takes
`config.training.max_norm` and, under pipeline parallelism, the pp group as `groups={"pp": ...}` (so a
norm not reduced across stages is named), and follows `trainer.step` (also after a checkpoint load).
Torchtitan's `dist_utils.clip_grad_norm_` is recorded as one clip call (its pp reduction and its
EP/non-EP split included), and any other clip call of the step is seen too. With several model parts
per rank pass `model=` a module whose parameter names are the logical ones.

Each checked step that torchtitan logs (`metrics.log_freq`) gets its `TrendLine.metrics()`
(`gradaudit/anomaly`, `gradaudit/true_norm`, `gradaudit/reported_over_true`, the reported norm being
the `grad_norm` torchtitan logs) in the `extra_metrics` of torchtitan's own
`trainer.metrics_processor.log` call: in the same TensorBoard/W&B step as that `grad_norm`, the
guard's number of the step (`trainer.step`). A step whose clipping is wrong and that torchtitan does not
log goes to its loggers all the same (`metrics_processor.logger.log`, at its own step), so that an alert
on `gradaudit/anomaly` fires whatever the log interval. Nothing for a step not checked (the step
captured in full after an anomaly, steps between `every=`). On GPU the step's verdict is read at
torchtitan's log call, where it syncs for its loss anyway; an anomaly of another step is logged at its
own step once read, at the next. A trainer without a metrics_processor is guarded all the same;
`on_verdict=` gets every checked step's line.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from ..live.guard import Guard
from ..live.trend import TrendLine
from .torchtitan import model_of, pp_groups


class TorchtitanGuard:
    """Wraps `trainer.train_step`, `trainer.metrics_processor.log` (when the trainer has one) and
    torchtitan's `clip_grad_norm_` until `remove()`; keywords go to the guard (every, on_anomaly,
    groups, on_verdict, ...). `.guard` is the Guard."""

    def __init__(
        self, trainer: Any, out_dir: str | os.PathLike[str], *, model: Any = None, **guard_kwargs: Any
    ) -> None:
        from torchtitan.distributed import utils as dist_utils  # type: ignore[import-untyped]

        self.trainer = trainer
        self._metrics = getattr(trainer, "metrics_processor", None)
        self._on_verdict = guard_kwargs.get("on_verdict")
        self.guard = Guard(
            model_of(trainer, model),
            max_norm=float(trainer.config.training.max_norm),
            optimizer=trainer.optimizers,
            out_dir=out_dir,
            first_step=int(trainer.step) + 1,
            **{
                **guard_kwargs,
                "groups": {**pp_groups(trainer), **(guard_kwargs.get("groups") or {})},
                "on_verdict": self._judged,
            },
        )
        self._dist_utils = dist_utils
        self._original_clip = dist_utils.clip_grad_norm_
        self._original_step = trainer.train_step

        @functools.wraps(self._original_clip)
        def clip(*args: Any, **kwargs: Any) -> Any:
            return self.guard.clip(self._original_clip, *args, **kwargs)

        self._clip = clip
        dist_utils.clip_grad_norm_ = clip
        trainer.train_step = self._train_step
        if self._metrics is not None:
            self._original_log = self._metrics.log
            self._metrics.log = self._log

    def _judged(self, line: TrendLine) -> None:
        """Every checked step's line: an anomaly of a step torchtitan does not log goes to its loggers
        (the metrics rank's; the others' log nothing), the rest waits for torchtitan's log call."""
        metrics = self._metrics
        if metrics is not None and not line.ok and not metrics.should_log(line.step):
            metrics.logger.log(line.metrics(), line.step)
        if self._on_verdict is not None:
            self._on_verdict(line)

    def _train_step(self, *args: Any, **kwargs: Any) -> Any:
        self.guard.step = int(self.trainer.step)  # the step under way, as torchtitan counts it
        return self._original_step(*args, **kwargs)

    def _log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> Any:
        """torchtitan 0.3.0's MetricsProcessor.log, with this step's line (never an older one's) in
        extra_metrics; reported/true is of the grad_norm logged beside it, this rank's (under pp the
        logging rank is the last stage's, whose norm differs from rank 0's when the pp mesh is left out)."""
        line = self.guard.line_of(int(step))
        values = {} if line is None else line.metrics(reported_norm=float(grad_norm))
        return self._original_log(
            step,
            global_avg_loss,
            global_max_loss,
            grad_norm,
            extra_metrics={**(extra_metrics or {}), **values} or extra_metrics,
        )

    def remove(self) -> None:
        """Stop the guard and restore `train_step`, `metrics_processor.log` and `clip_grad_norm_`."""
        self.guard.remove()
        vars(self.trainer).pop("train_step", None)
        if self._metrics is not None:
            vars(self._metrics).pop("log", None)
        if self._dist_utils.clip_grad_norm_ is self._clip:
            self._dist_utils.clip_grad_norm_ = self._original_clip
