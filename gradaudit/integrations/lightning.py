"""Lightning: a callback that audits the selected optimizer steps of a `Trainer` that clips by norm.

    trainer = Trainer(gradient_clip_val=1.0, gradient_clip_algorithm="norm", strategy="ddp",
                      callbacks=[GradAuditCallback("audit", steps=[100])])

At the first micro-batch of a selected step (`on_train_batch_start`) the callback begins an audit, so
that every clip call made during the step is recorded, and routes the module's `configure_gradient_clipping` hook through
`audit.clip`, so the dump holds the gradients before and after Lightning (or the user's override)
clipped. Lightning's `clip_gradients` returns None; the norm it clipped with is read from the
`torch.nn.utils.clip_grad_norm_` (or FSDP `clip_grad_norm_`) call made inside the hook. The audit is
written at `on_train_batch_end`, after the optimizer step.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from ..capture.arguments import norm_results, opt_float
from ..capture.session import AuditStep
from ..capture.steps import select_steps
from ..model import Mode
from ..warn import warn_once


class GradAuditCallback(Callback):
    """Audit the optimizer steps `steps=[...]` (counted from 1: `trainer.global_step` after the step) or
    every N-th (`every=N`); `mode="full"` or `"stats"`; other keywords go to `gradaudit.audit_step`."""

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        steps: Iterable[int] | int | None = None,
        every: int | None = None,
        mode: Mode = "full",
        **audit_kwargs: Any,
    ) -> None:
        self.out_dir = out_dir
        self.selection = select_steps(steps, every)
        self.mode = mode
        self.audit_kwargs = audit_kwargs
        self.audit: AuditStep | None = None
        self.paths: list[Path] = []
        """Rank files written so far on this rank."""
        self._restore: list[tuple[Any, str, bool, Any]] = []
        self._stepping = False

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """Begin at the first micro-batch of a selected step, so that a clip made in a hook of the step
        (`on_after_backward`, `training_step`) is recorded too (GA501), not only Lightning's."""
        if batch_idx % max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1)) == 0:
            self._begin(trainer, pl_module)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._begin(trainer, pl_module)
        self._stepping = self.audit is not None  # the audit ends after this batch (the optimizer step's)

    def _begin(self, trainer: Any, pl_module: Any) -> None:
        step = trainer.global_step + 1
        if self.audit is not None or not self.selection.wants(step):
            return
        max_norm = trainer.gradient_clip_val
        algorithm = str(
            getattr(trainer.gradient_clip_algorithm, "value", trainer.gradient_clip_algorithm) or "norm"
        )
        if not max_norm or algorithm != "norm":
            warn_once(
                "lightning:no-norm-clipping",
                f"gradaudit: the Trainer does not clip by norm (gradient_clip_val={max_norm}, "
                f"gradient_clip_algorithm={algorithm!r}); nothing to audit",
            )
            return
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        audit = AuditStep(
            model,
            self.out_dir,
            step=step,
            max_norm=float(max_norm),
            scaler=getattr(trainer.precision_plugin, "scaler", None),
            mode=self.mode,
            **self.audit_kwargs,
            capture_api="lightning.GradAuditCallback",
        ).begin()
        self.audit = audit
        original = pl_module.configure_gradient_clipping

        def configure_gradient_clipping(*args: Any, **kwargs: Any) -> Any:
            listening = [
                self._listen(torch.nn.utils, "clip_grad_norm_"),
                self._listen(model, "clip_grad_norm_"),
            ]
            try:
                return audit.clip(original, *args, **kwargs)
            finally:
                for undo in reversed(listening):
                    undo()
                audit.before_optimizer_step()  # clipping is done; the optimizer step's body follows

        self._patch(pl_module, "configure_gradient_clipping", configure_gradient_clipping)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._stepping:
            return  # a micro-batch before the step's last: the audit stays open
        self._stepping = False
        audit, self.audit = self.audit, None
        self._unpatch()
        if audit is None:
            return
        audit.after_optimizer_step()
        path = audit.end()
        if path is not None:
            self.paths.append(path)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._unpatch()
        self._stepping = False
        if self.audit is not None:
            self.audit.cancel()
            self.audit = None

    def _listen(self, owner: Any, name: str) -> Any:
        """Record the norm `owner.<name>` returns while the clipping hook runs; returns the undo."""
        original = getattr(owner, name, None)
        if original is None or not callable(original):
            return lambda: None
        audit = self.audit

        def clip(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            norm = opt_float(norm_results(result)[0])
            if audit is not None and norm is not None:
                audit.record(reported_norm=norm)
            return result

        own = vars(owner) if hasattr(owner, "__dict__") else {}
        had_own, before = name in own, own.get(name)
        setattr(owner, name, clip)

        def undo() -> None:
            if had_own:
                setattr(owner, name, before)
            else:
                delattr(owner, name)

        return undo

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        own = vars(owner)
        self._restore.append((owner, name, name in own, own.get(name)))
        setattr(owner, name, value)

    def _unpatch(self) -> None:
        for owner, name, had_own, before in reversed(self._restore):
            if had_own:
                setattr(owner, name, before)
            else:
                delattr(owner, name)
        self._restore.clear()
