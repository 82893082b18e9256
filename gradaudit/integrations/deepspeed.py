"""DeepSpeed ZeRO (stages 1-3): audit the selected optimizer steps of a DeepSpeed engine.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    DeepSpeedAudit(engine, "audit", steps=[100])           # the one added line
    for batch in loader:
        engine.backward(loss_fn(engine(batch)))
        engine.step()

ZeRO clips inside `engine.step()`, on the flat gradient partitions each rank owns. At the step's
gradient-accumulation boundary the audit records, just before `engine.step()`, this rank's partition
of every parameter's gradient as a flat range of that parameter (ZeRO-1/2: the parameter's fragment
of the rank's optimizer partition; ZeRO-3: its `ds_tensor` partition), and after it the norm DeepSpeed
clipped with (`engine.get_global_grad_norm()`). The clipped gradients and the parameters are not
captured: ZeRO frees the gradient partitions inside the step.

With `gradient_clipping: 0` in the config and clipping done by hand between `engine.backward` and
`engine.step` (e.g. through `deepspeed.utils.safe_get_local_grad` / `safe_set_local_grad`), pass the
norm you clip to as `max_norm=`: the audit then records this rank's partitions after the boundary
backward and again just before `engine.step`, and the checker judges the coefficient your code
applied on each rank.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..capture.ownership import LocalPiece
from ..capture.session import AuditStep
from ..capture.steps import select_steps
from ..model import FlatRange


class DeepSpeedAudit:
    """Wraps `engine.step`; `steps=[...]` or `every=N` count optimizer steps from 1."""

    def __init__(
        self,
        engine: Any,
        out_dir: str | os.PathLike[str],
        *,
        steps: Iterable[int] | int | None = None,
        every: int | None = None,
        max_norm: float | None = None,
        **audit_kwargs: Any,
    ) -> None:
        self.engine = engine
        self.out_dir = out_dir
        self.selection = select_steps(steps, every)
        self.max_norm = max_norm
        """The norm clipped to by hand (DeepSpeed's own gradient_clipping is 0); None when DeepSpeed clips."""
        self.audit_kwargs = audit_kwargs
        self.paths: list[Path] = []
        self._by_hand: tuple[AuditStep, list[bool]] | None = None
        self._original = engine.step
        self._original_backward = engine.backward
        engine.step = self._step
        engine.backward = self._backward

    def remove(self) -> None:
        """Uninstall: restore `engine.step` and `engine.backward`; an audit left open writes nothing."""
        if self._by_hand is not None:
            self._by_hand[0].cancel()
            self._by_hand = None
        vars(self.engine).pop("step", None)
        vars(self.engine).pop("backward", None)

    def _boundary_step(self) -> int | None:
        """The optimizer step this micro-batch completes, when it is a boundary and one to audit."""
        step = int(self.engine.global_steps) + 1
        wanted = self.engine.is_gradient_accumulation_boundary() and self.selection.wants(step)
        return step if wanted else None

    def _open(self, step: int, max_norm: float) -> tuple[AuditStep, list[bool]]:
        import torch

        readable = [True]
        audit = AuditStep(
            torch.nn.Module(),  # nothing to infer: every piece is described below
            self.out_dir,
            step=step,
            max_norm=max_norm,
            ownership=zero_pieces(self.engine, readable),
            **self.audit_kwargs,
            capture_api="DeepSpeedAudit",
        ).begin()
        return audit, readable

    def _backward(self, *args: Any, **kwargs: Any) -> Any:
        result = self._original_backward(*args, **kwargs)
        clips_itself = float(self.engine.gradient_clipping() or 0.0) > 0
        step = self._boundary_step()
        if self.max_norm is not None and not clips_itself and step is not None and self._by_hand is None:
            self._by_hand = self._open(step, float(self.max_norm))
            self._by_hand[0].take_gradients(clipped=False)
        return result

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if self._by_hand is not None:
            return self._step_clipped_by_hand(*args, **kwargs)
        engine = self.engine
        max_norm = float(engine.gradient_clipping() or 0.0)
        step = self._boundary_step()
        if step is None or max_norm <= 0:
            return self._original(*args, **kwargs)
        audit, readable = self._open(step, max_norm)

        def step_then_close(*args: Any, **kwargs: Any) -> Any:
            result = self._original(*args, **kwargs)
            readable[0] = False  # ZeRO has freed its gradient partitions
            return result

        result = audit.clip(step_then_close, *args, **kwargs)
        audit.record(reported_norm=engine.get_global_grad_norm())
        path = audit.end()
        if path is not None:
            self.paths.append(path)
        return result

    def _step_clipped_by_hand(self, *args: Any, **kwargs: Any) -> Any:
        assert self._by_hand is not None
        (audit, readable), self._by_hand = self._by_hand, None
        audit.take_gradients(clipped=True)
        try:
            result = self._original(*args, **kwargs)
        except BaseException:
            audit.cancel()
            raise
        readable[0] = False
        path = audit.end()
        if path is not None:
            self.paths.append(path)
        return result


def zero_pieces(engine: Any, readable: list[bool]) -> list[LocalPiece]:
    """This rank's flat partition of each parameter, with readers of its gradient (None once
    `readable[0]` is False) and values."""
    stage = int(engine.zero_optimization_stage())
    pieces = []
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        piece = _zero3_piece(name, param, readable) if stage == 3 else _zero12_piece(name, param, readable)
        if piece is not None:
            pieces.append(piece)
    return pieces


def _dtype(param: Any) -> str:
    return str(param.dtype).removeprefix("torch.")


def _zero12_piece(name: str, param: Any, readable: list[bool]) -> LocalPiece | None:
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None  # this rank's optimizer partition holds no element of this parameter
    start, numel = int(mapping.lp_fragment_address.start), int(mapping.lp_fragment_address.numel)
    index = param._index_in_param_group

    def grad() -> Any:
        if not readable[0]:
            return None
        fragment = mapping.get_lp_grad_fragment(index).reshape(-1)
        if fragment.numel() == param.numel():  # a full-size accumulation buffer: keep this rank's part
            fragment = fragment.narrow(0, start, numel)
        return fragment

    return LocalPiece(
        param=name,
        global_shape=tuple(param.shape),
        dtype=_dtype(param),
        regions=(FlatRange(start=start, stop=start + numel),),
        local_shape=(numel,),
        grad=grad,
        value=lambda: param.detach().reshape(-1).narrow(0, start, numel),
    )


def _zero3_piece(name: str, param: Any, readable: list[bool]) -> LocalPiece | None:
    import torch.distributed as dist
    from deepspeed.utils import safe_get_local_grad

    partition = param.ds_tensor
    size = int(partition.ds_numel)  # every rank's partition has this size, the last one padded
    start = size * dist.get_rank(group=param.ds_process_group)
    numel = max(0, min(size, int(param.ds_numel) - start))
    if numel == 0:
        return None
    return LocalPiece(
        param=name,
        global_shape=tuple(param.ds_shape),
        dtype=_dtype(param),
        regions=(FlatRange(start=start, stop=start + numel),),
        local_shape=(numel,),
        grad=lambda: safe_get_local_grad(param).reshape(-1).narrow(0, 0, numel) if readable[0] else None,
        value=lambda: partition.reshape(-1).narrow(0, 0, numel),
    )
