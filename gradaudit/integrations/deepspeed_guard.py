"""DeepSpeed ZeRO (stages 1-3): the guard in one line after `deepspeed.initialize`.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    DeepSpeedGuard(engine, "audit")                 # the one added line
    for batch in loader:
        engine.backward(loss_fn(engine(batch)))
        engine.step()

ZeRO clips inside `engine.step()`, on the flat fp32 copies of the gradient partitions, and frees the
partitions in the same call. At each gradient-accumulation boundary the guard measures this rank's
partition of every parameter's gradient (the pieces `DeepSpeedAudit` records) just before
`engine.step()`, and takes the norm DeepSpeed clipped with (`engine.get_global_grad_norm()`) as the
step's clip call: a norm that is not the true global norm of the owned elements is named at its step.
The coefficient DeepSpeed applied is measured inside `engine.step()`: ZeRO divides each flat fp32
gradient partition in place by loss scale x clip factor (`unscale_and_clip_grads`, stages 1-3, where
clip factor = max(1, (norm + 1e-6) / gradient_clipping)); the guard samples a fixed set of elements of
each partition before and after that call, so the coefficient is the one applied, not the one the
formula gives (times the loss scale of the backward, 1 without fp16). With fp16 the partitions carry
DeepSpeed's loss scale, which the guard divides out of what it measures. The step after an anomaly is
captured in full under out_dir/full/ (this rank's gradient partitions before `engine.step()`, the
norm DeepSpeed clipped with, the update), as `DeepSpeedAudit` captures a chosen step; not under a loss
scale other than 1, which a capture does not record. A clip call of the user's own in the step is seen
as under any stack.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CaptureError
from ..live.guard import Guard
from ..live.summary import coefficient, float64_cat, strided_sample
from .deepspeed import zero_pieces

SAMPLE_PER_PARTITION = 64


@contextlib.contextmanager
def _sampled_clip(zero_optimizer: Any, samples: list[tuple[Any, Any]]) -> Iterator[None]:
    """Sample the flat fp32 gradient partitions ZeRO clips around each of its `unscale_and_clip_grads`
    calls (one per parameter group, or per sub-group under ZeRO-3), which divide them in place by the
    loss scale times the clip factor; without that method (another optimizer) nothing is sampled."""
    original = getattr(zero_optimizer, "unscale_and_clip_grads", None)
    if original is None:
        yield
        return

    def unscale_and_clip_grads(first: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(first, int):  # ZeRO-3: a sub-group's index
            flat = [zero_optimizer.fp32_partitioned_groups_flat[first].grad]
        else:  # ZeRO-1/2: the flat partitions, or lists of them
            flat = [t for g in first for t in (g if isinstance(g, list) else [g])]
        before = strided_sample(flat, SAMPLE_PER_PARTITION)
        result = original(first, *args, **kwargs)
        after = strided_sample(flat, SAMPLE_PER_PARTITION)
        if before is not None and after is not None:
            samples.append((before, after))
        return result

    own = vars(zero_optimizer).get("unscale_and_clip_grads")  # a wrapper of the user's stays
    zero_optimizer.unscale_and_clip_grads = unscale_and_clip_grads
    try:
        yield
    finally:
        if own is not None:
            zero_optimizer.unscale_and_clip_grads = own
        else:
            del zero_optimizer.unscale_and_clip_grads


class _EngineStep(torch.optim.Optimizer):
    """A torch optimizer of nothing whose step is `engine.step()` at a boundary: its step hooks are
    the guard's (before the step: the pending verdict; after it: the step's summary, gathered)."""

    def __init__(self) -> None:
        super().__init__([torch.zeros(0, requires_grad=True)], {})

    def step(self, closure: Any = None) -> Any:
        return closure()


class DeepSpeedGuard:
    """Wraps `engine.step` until `remove()`; keywords go to the guard (every, on_anomaly, ...). The
    max_norm is the config's `gradient_clipping`. `.guard` is the Guard."""

    def __init__(self, engine: Any, out_dir: str | os.PathLike[str], **guard_kwargs: Any) -> None:
        max_norm = float(engine.gradient_clipping() or 0.0)
        if max_norm <= 0:
            raise CaptureError(
                "DeepSpeedGuard checks DeepSpeed's own clipping, and the config's gradient_clipping is 0; "
                "set it, or clip by hand through gradaudit.guard(..., ownership=zero_pieces(engine, [True]))"
            )
        self.engine = engine
        self._readable = [True]
        self._steps = _EngineStep()
        self.guard = Guard(
            engine.module,
            max_norm=max_norm,
            optimizer=self._steps,
            out_dir=out_dir,
            ownership=zero_pieces(engine, self._readable),
            first_step=int(engine.global_steps) + 1,
            **guard_kwargs,
        )
        self._capture_next = self.guard.capture_next
        self._original = engine.step
        engine.step = self._step

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.engine.is_gradient_accumulation_boundary():
            return self._original(*args, **kwargs)
        returned: list[Any] = []
        samples: list[tuple[Any, Any]] = []  # (before, after) of each unscale_and_clip_grads call

        def deepspeed_step(*args: Any, max_norm: float = self.guard.max_norm, **kwargs: Any) -> Any:
            try:
                with _sampled_clip(self.engine.optimizer, samples):
                    returned.append(self._original(*args, **kwargs))
            finally:
                self._readable[0] = False  # ZeRO has freed its gradient partitions
            return self.engine.get_global_grad_norm()

        def step() -> Any:
            # the loss scale of the backward (1 without fp16): the partitions read before engine.step()
            # carry it, and ZeRO divides it out with its clip factor
            scale = float(getattr(self.engine.optimizer, "loss_scale", 1.0) or 1.0)
            self.guard.capture_next = self._capture_next and scale == 1.0
            norm = self.guard.clip_unscaling(scale, deepspeed_step, *args, **kwargs)
            if samples:
                before, after = (float64_cat(list(s)) for s in zip(*samples, strict=True))
                self.guard.applied(coefficient(before, after) * scale)
            return norm

        self._readable[0] = True
        self._steps.step(step)
        return returned[0] if returned else None

    def remove(self) -> None:
        """Stop the guard and restore `engine.step`."""
        self.guard.remove()
        vars(self.engine).pop("step", None)
