"""HF `Trainer`: a callback that audits the selected optimizer steps, with no patching by the user.

    trainer = Trainer(model=model, args=TrainingArguments(..., max_grad_norm=1.0), ...)
    trainer.add_callback(GradAuditCallback("audit", steps=[100]))

At `on_step_begin` of a selected step the callback begins an audit and routes the Trainer's clipping
(`Trainer._clip_grad_norm`, which calls `accelerator.clip_grad_norm_`) through `audit.clip`; so the
dump holds the gradients just before the Trainer clips, after it clipped, the norm it logs as
`grad_norm`, and the parameters around the optimizer step. The audit is written at `on_optimizer_step`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from types import FrameType
from typing import Any

from transformers import Trainer, TrainerCallback

from ..capture.session import AuditStep
from ..capture.steps import select_steps
from ..model import Mode
from ..warn import warn_once
from .accelerate import unscaled_first

CLIP_EPS = 1e-6
"""torch.nn.utils.clip_grad_norm_'s epsilon: coef = max_norm / (norm + 1e-6), at most 1."""


class GradAuditCallback(TrainerCallback):
    """Audit the optimizer steps `steps=[...]` (counted from 1, as `state.global_step` after the step)
    or every N-th (`every=N`); `mode="full"` (gradient values) or `"stats"` (float64 summaries).

    Other keywords go to `gradaudit.audit_step` (groups, aliases, strict, ...). The Trainer is found
    when training begins; pass `trainer=` when the callback is driven by something else.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        steps: Iterable[int] | int | None = None,
        every: int | None = None,
        mode: Mode = "full",
        trainer: Any = None,
        **audit_kwargs: Any,
    ) -> None:
        self.out_dir = out_dir
        self.selection = select_steps(steps, every)
        self.mode = mode
        self.trainer = trainer
        self.audit_kwargs = audit_kwargs
        self.audit: AuditStep | None = None
        self.paths: list[Path] = []
        """Rank files written so far on this rank."""
        self._totals: dict[str, Any] | None = None
        self._uncount: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is None:
            self.trainer = _calling_trainer()
        if self.trainer is None:
            warn_once(
                "hf:no-trainer",
                "gradaudit: GradAuditCallback could not find the Trainer that runs it and audits nothing; "
                "pass it as GradAuditCallback(..., trainer=trainer)",
            )

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step + 1
        trainer = self.trainer
        if trainer is None or self.audit is not None or not self.selection.wants(step):
            return
        if not args.max_grad_norm or args.max_grad_norm <= 0:
            warn_once(
                "hf:no-clipping",
                f"gradaudit: the Trainer does not clip (max_grad_norm={args.max_grad_norm}); nothing to audit",
            )
            return
        accelerator = getattr(trainer, "accelerator", None)
        self.audit = AuditStep(
            getattr(trainer, "model_wrapped", None) or trainer.model,
            self.out_dir,
            step=step,
            max_norm=args.max_grad_norm,
            optimizer=trainer.optimizer,
            scaler=getattr(accelerator, "scaler", None),
            mode=self.mode,
            **self.audit_kwargs,
            capture_api="transformers.GradAuditCallback",
        ).begin()
        # Trainer._clip_grad_norm covers every path the Trainer clips by (Accelerate's clip_grad_norm_,
        # its mixed-mesh norm); Trainers without it clip through Accelerate.
        owner, name = (
            (trainer, "_clip_grad_norm")
            if callable(getattr(trainer, "_clip_grad_norm", None))
            else (accelerator, "clip_grad_norm_")
        )
        self.audit.intercept_clip(owner, name)
        if getattr(accelerator, "scaler", None) is not None:
            # fp16: unscale before the audit records the gradients (end() restores the attribute).
            routed = getattr(owner, name)

            def clip(*args: Any, **kwargs: Any) -> Any:
                with unscaled_first(accelerator):
                    return routed(*args, **kwargs)

            setattr(owner, name, clip)
        self._count_batches(trainer)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer logs as grad_norm what its clip call returned (the audit records that already);
        # the coefficient it applied follows from it by clip_grad_norm_'s rule.
        norms = self.audit.reported_norms if self.audit is not None else ()
        norm = norms[-1] if norms else None
        if self.audit is not None and norm is not None and math.isfinite(norm):
            self.audit.record(clip_coef=min(1.0, args.max_grad_norm / (norm + CLIP_EPS)))

    def _count_batches(self, trainer: Any) -> None:
        """Sum this rank's loss and label tokens over the step's micro-batches (until the audit ends)."""
        original = trainer.training_step
        totals: dict[str, Any] = {"loss": 0.0, "tokens": 0, "global": False}

        def training_step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = original(model, inputs, num_items_in_batch)
            labels = inputs.get("labels") if isinstance(inputs, dict) else None
            if labels is not None and hasattr(labels, "ne"):
                totals["tokens"] += int(labels.ne(-100).sum())
            totals["loss"] += float(loss.detach())
            totals["global"] = totals["global"] or num_items_in_batch is not None
            return loss

        trainer.training_step = training_step
        self._uncount = lambda: vars(trainer).pop("training_step", None)
        self._totals = totals

    def _stop_counting(self) -> None:
        if self._uncount is not None:
            self._uncount()
            self._uncount = None

    def _record_batches(self) -> None:
        totals = self._totals
        if self.audit is None or totals is None:
            return
        # With num_items_in_batch the Trainer divides each loss by the step's token count over all
        # ranks (a sum over tokens, normalized once); without it each micro-batch averages its own.
        self.audit.record(
            loss=totals["loss"],
            tokens=totals["tokens"] or None,
            loss_reduction="sum" if totals["global"] else "mean",
        )

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_counting()
        self._record_batches()
        self._totals = None
        audit, self.audit = self.audit, None
        if audit is not None:
            path = audit.end()
            if path is not None:
                self.paths.append(path)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on_optimizer_step(args, state, control, **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stop_counting()
        if self.audit is not None:
            self.audit.cancel()
            self.audit = None


def _calling_trainer() -> Any:
    """The Trainer whose training loop is calling the callbacks (found on the call stack)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None
