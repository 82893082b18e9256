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
What DeepSpeed's clip applied cannot be seen (the clipped fp32 copies are freed inside the step), so
the coefficient is not checked; nor is the next step captured in full (`DeepSpeedAudit(steps=[N])`
captures a chosen step). A clip call of the user's own in the step is seen as under any stack.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..errors import CaptureError
from ..live.guard import Guard
from .deepspeed import zero_pieces


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
            **{"capture_next": False, **guard_kwargs},
        )
        self._original = engine.step
        engine.step = self._step

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if not self.engine.is_gradient_accumulation_boundary():
            return self._original(*args, **kwargs)
        returned: list[Any] = []

        def deepspeed_step(*args: Any, max_norm: float = self.guard.max_norm, **kwargs: Any) -> Any:
            try:
                returned.append(self._original(*args, **kwargs))
            finally:
                self._readable[0] = False  # ZeRO has freed its gradient partitions
            return self.engine.get_global_grad_norm()

        self._readable[0] = True
        self._steps.step(lambda: self.guard.clip(deepspeed_step, *args, **kwargs))
        return returned[0] if returned else None

    def remove(self) -> None:
        """Stop the guard and restore `engine.step`."""
        self.guard.remove()
        vars(self.engine).pop("step", None)
