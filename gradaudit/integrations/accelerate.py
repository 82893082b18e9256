"""Accelerate: one audit per optimizer step, across gradient-accumulation micro-batches.

    accelerator = Accelerator(gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    AccelerateAudit(accelerator, model, optimizer, "audit", steps=[100])   # the one added line
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(batch)))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()

Every call of `accelerator.clip_grad_norm_` is recorded: the audit of a selected step opens at that
step's first clip call (a clip call on a micro-batch that does not sync is recorded too, so clipping
every micro-batch shows up as GA501) and is written right after the optimizer really steps. With fp16
and a GradScaler the audit records the scaler and unscales the gradients (`accelerator.unscale_gradients`)
just before each recorded clip call, as Accelerate's `clip_grad_norm_` itself does first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..capture.optimizers import hookable_optimizer
from ..capture.session import AuditStep
from ..capture.steps import select_steps
from ..errors import CaptureError


class AccelerateAudit:
    """Audits the selected optimizer steps of an Accelerate loop; installs itself on construction.

    Arguments: the Accelerator, the prepared model and optimizer, the dump folder; `steps=[...]` or
    `every=N` (optimizer steps counted from 1; default: step 1); `first_step=` the number of the next
    optimizer step when resuming; `max_norm=` (default: the max_norm of the step's first clip call);
    any other keyword of `gradaudit.audit_step` (mode, groups, strict, ...).
    """

    def __init__(
        self,
        accelerator: Any,
        model: Any,
        optimizer: Any,
        out_dir: str | os.PathLike[str],
        *,
        steps: Iterable[int] | int | None = None,
        every: int | None = None,
        first_step: int = 1,
        max_norm: float | None = None,
        **audit_kwargs: Any,
    ) -> None:
        if "step" in audit_kwargs or "optimizer" in audit_kwargs:
            raise CaptureError("AccelerateAudit numbers the steps and hooks the optimizer itself; drop step=")
        torch_optimizer = hookable_optimizer(optimizer)
        if torch_optimizer is None:
            raise CaptureError(
                "AccelerateAudit needs the optimizer returned by accelerator.prepare (or its torch optimizer)"
            )
        self.accelerator = accelerator
        self.model = model
        self.out_dir = out_dir
        self.selection = select_steps(steps, every)
        self.max_norm = max_norm
        self.audit_kwargs = audit_kwargs
        self.next_step = first_step
        """The number of the optimizer step the current micro-batches contribute to."""
        self.audit: AuditStep | None = None
        self.paths: list[Path] = []
        """Rank files written so far on this rank."""
        self._original_clip = accelerator.clip_grad_norm_
        self._handles = [
            torch_optimizer.register_step_pre_hook(self._before_step),
            torch_optimizer.register_step_post_hook(self._after_step),
        ]
        accelerator.clip_grad_norm_ = self._clip

    def remove(self) -> None:
        """Uninstall: restore `accelerator.clip_grad_norm_` and drop the optimizer hooks."""
        if self.audit is not None:
            self.audit.cancel()
            self.audit = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        vars(self.accelerator).pop("clip_grad_norm_", None)

    def _clip(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        if self.audit is None and self.selection.wants(self.next_step):
            self.audit = AuditStep(
                self.model,
                self.out_dir,
                step=self.next_step,
                max_norm=self.max_norm if self.max_norm is not None else max_norm,
                norm_type=norm_type,
                scaler=getattr(self.accelerator, "scaler", None),
                **self.audit_kwargs,
                capture_api="AccelerateAudit",
            ).begin()
        if self.audit is None:
            return self._original_clip(parameters, max_norm, norm_type)
        with unscaled_first(self.accelerator):
            return self.audit.clip(self._original_clip, parameters, max_norm, norm_type=norm_type)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.audit is not None:
            self.audit.before_optimizer_step()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.next_step += 1
        audit, self.audit = self.audit, None
        if audit is not None:
            audit.after_optimizer_step()
            path = audit.end()
            if path is not None:
                self.paths.append(path)


@contextlib.contextmanager
def unscaled_first(accelerator: Any) -> Iterator[None]:
    """Run Accelerate's fp16 unscale now and skip the one its clip_grad_norm_ runs first.

    Accelerate unscales inside `clip_grad_norm_`, after an audit wrapped around the call would have
    recorded the gradients (still multiplied by the loss scale). Unscaling before the audit records
    them gives the gradients the norm is taken of, and the call records unscaled=True. The second
    unscale is skipped: GradScaler.unscale_ raises when called twice before update(). Without a
    scaler (no fp16) this does nothing."""
    if getattr(accelerator, "scaler", None) is None:
        yield
        return
    accelerator.unscale_gradients()
    own = vars(accelerator)
    had_own, original = "unscale_gradients" in own, own.get("unscale_gradients")
    accelerator.unscale_gradients = lambda optimizer=None: None
    try:
        yield
    finally:
        if had_own:
            accelerator.unscale_gradients = original
        else:
            del accelerator.unscale_gradients
