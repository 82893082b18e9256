"""torchtitan: audit the selected steps of a torchtitan `Trainer` (or a loop that clips with its
`torchtitan.distributed.utils.clip_grad_norm_`).

    trainer = Trainer(config)                                  # torchtitan/train.py builds this
    TorchtitanAudit(trainer, "audit", steps=[100])             # the one added line
    trainer.train()

Each selected `train_step` runs inside an audit: the call of `dist_utils.clip_grad_norm_` (its pp
mesh reduction and its EP/non-EP split included) is routed through `audit.clip`, and
`trainer.optimizers` (an OptimizersContainer, a hookable torch optimizer) gives the parameters
around the step. The pipeline group is passed as `groups={"pp": ...}` so that the report can name a
norm that was not reduced across stages. With several model parts per rank (interleaved pipeline
schedules) pass `model=` a module whose parameter names are the logical ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..capture.session import AuditStep
from ..capture.steps import select_steps
from ..errors import CaptureError


class TorchtitanAudit:
    """Wraps `trainer.train_step`; `steps=[...]` or `every=N` are torchtitan's `trainer.step` numbers."""

    def __init__(
        self,
        trainer: Any,
        out_dir: str | os.PathLike[str],
        *,
        steps: Iterable[int] | int | None = None,
        every: int | None = None,
        model: Any = None,
        **audit_kwargs: Any,
    ) -> None:
        from torchtitan.distributed import utils as dist_utils  # type: ignore[import-untyped]

        self.trainer = trainer
        self.model = model_of(trainer, model)
        self.out_dir = out_dir
        self.selection = select_steps(steps, every)
        self.audit_kwargs = audit_kwargs
        self.paths: list[Path] = []
        self._dist_utils = dist_utils
        self._original = trainer.train_step
        trainer.train_step = self._train_step

    def remove(self) -> None:
        vars(self.trainer).pop("train_step", None)

    def _train_step(self, *args: Any, **kwargs: Any) -> Any:
        step = int(self.trainer.step)
        if not self.selection.wants(step):
            return self._original(*args, **kwargs)
        config = self.trainer.config
        audit_kwargs = {"groups": pp_groups(self.trainer), **self.audit_kwargs}
        audit = AuditStep(
            self.model,
            self.out_dir,
            step=step,
            max_norm=float(config.training.max_norm),
            optimizer=self.trainer.optimizers,
            **audit_kwargs,
            capture_api="TorchtitanAudit",
        ).begin()
        audit.intercept_clip(self._dist_utils, "clip_grad_norm_")
        try:
            result = self._original(*args, **kwargs)
        except BaseException:
            audit.cancel()
            raise
        path = audit.end()
        if path is not None:
            self.paths.append(path)
        return result


def model_of(trainer: Any, model: Any) -> Any:
    """The module to audit: `model` when given, else the trainer's one model part."""
    parts = list(getattr(trainer, "model_parts", ()))
    if model is None and len(parts) != 1:
        raise CaptureError(
            f"this rank holds {len(parts)} model parts; pass model= a module whose parameter names are "
            "the model's own (e.g. the one part that is being audited)"
        )
    return model if model is not None else parts[0]


def pp_groups(trainer: Any) -> dict[str, Any]:
    """{"pp": the pipeline group} when the trainer's parallel_dims has a pp mesh, else {}."""
    parallel_dims = getattr(trainer, "parallel_dims", None)
    get_mesh = getattr(parallel_dims, "get_optional_mesh", None)
    pp_mesh = get_mesh("pp") if callable(get_mesh) else None
    return {} if pp_mesh is None else {"pp": pp_mesh.get_group()}
