"""`audit_step`: the context that records one training step on this rank and writes its dump file."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..dumpfile.writer import DumpExistsError
from ..errors import CaptureError
from ..model import ClipCall, ClipRecord, DataRecord
from .arguments import (
    MODES,
    check_max_norm,
    check_norm_type,
    check_run_id,
    check_step,
    check_tokens,
    clip_arguments,
    norm_results,
    opt_float,
    opt_int,
    rank_and_world_size,
)
from .infer import Ownership, infer_ownership
from .ownership import LocalPiece
from .scaler import ScalerWatch
from .snapshots import Snapshots
from .topology import axis_names, normalize_groups, with_norm_group
from .warn import warn_once
from .write import build_rank_dump, write_dump

if TYPE_CHECKING:
    import torch


class AuditStep:
    """Records one optimizer step on this rank; see `gradaudit.audit_step` for the arguments.

    Everything that can fail while capturing or writing warns once and lets training go on (unless
    `strict`); mistakes in the call itself raise CaptureError at once.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        out_dir: str | os.PathLike,
        *,
        step: int,
        max_norm: float | None = None,
        norm_type: float | str = 2.0,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        groups: Mapping[str, Any] | None = None,
        aliases: Mapping[str, str] | None = None,
        ownership: Sequence[LocalPiece] | None = None,
        mode: str = "full",
        full_params: Sequence[str] = (),
        strict: bool = False,
        run_id: str | None = None,
    ) -> None:
        self.model = model
        self.out_dir = out_dir
        self.step = check_step(step)
        self.max_norm = check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        if mode not in MODES:
            raise CaptureError(
                f"unknown mode {mode!r}; pass mode='full' (gradient values) or mode='stats' (float64 summaries)"
            )
        if isinstance(full_params, str):
            full_params = (full_params,)
        if ownership is not None and not all(isinstance(p, LocalPiece) for p in ownership):
            raise CaptureError("ownership= takes a list of gradaudit.capture.LocalPiece, one per local piece")
        self.optimizer = optimizer
        self.scaler = scaler
        self.mode = mode
        self.full_params = tuple(full_params)
        self.strict = strict
        self.run_id = check_run_id(run_id)
        self.rank, self.world_size = rank_and_world_size()
        self._groups = normalize_groups(groups, world_size=self.world_size)
        self._aliases = dict(aliases or {})
        self._explicit = tuple(ownership or ())
        self._ownership: Ownership | None = None
        self._snapshots: Snapshots | None = None
        self._calls: list[dict] = []
        self._logged: dict[str, Any] = {}
        self._hooks: list = []
        self._active = False
        self._stepped = False
        self._scaler = ScalerWatch(scaler, optimizer)
        self._loss_scale: float | None = None
        self._norm_mesh: tuple[tuple[int, ...], str] | None = None
        """(ranks, name) of the mesh a DTensor norm returned by the clipping function was reduced over."""
        self.path = None
        """Where the rank file was written (None until the context exits, or when writing failed)."""

    # -- the context -------------------------------------------------------------------------

    def __enter__(self) -> AuditStep:
        try:
            self._guard("capture", self._start)
            if self._recording:
                self._guard("capture", self._read_scaler_at_start)
        except BaseException:
            self._remove_hooks()  # strict mode raised: leave nothing registered behind
            raise
        self._active = True
        return self

    def _start(self) -> None:
        ownership = infer_ownership(
            self.model,
            rank=self.rank,
            world_size=self.world_size,
            groups=self._groups,
            aliases=self._aliases,
            explicit=self._explicit,
            on_unsupported=self._unsupported,
        )
        snapshots = Snapshots(
            ownership.pieces,
            mode=self.mode,
            norm_type=self.norm_type,
            full_params=self.full_params,
            on_error=self._unsupported,
        )
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_pre_hook(self._before_optimizer_step))
            self._hooks.append(self.optimizer.register_step_post_hook(self._after_optimizer_step))
        self._ownership, self._snapshots = ownership, snapshots

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @property
    def _recording(self) -> bool:
        """False when the capture could not start: the step then runs exactly as without gradaudit."""
        return self._snapshots is not None

    def __exit__(self, exc_type, exc, tb) -> None:
        self._active = False
        self._remove_hooks()
        if exc_type is not None or not self._recording:
            return  # the step itself failed: its exception matters, not a half-recorded dump
        self._guard("write", self._finish)

    # -- what training code calls -------------------------------------------------------------

    def clip(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """Call `fn(*args, **kwargs)` and return what it returns, recording gradients around it."""
        if not self._active:
            raise CaptureError(
                "audit.clip() was called outside its `with gradaudit.audit_step(...)` block; call it inside"
            )
        first = not self._calls
        call: dict[str, Any] = {"reported": None, "reported_local": None}
        if self._recording:
            self._guard("capture", lambda: self._before_clip(call, first))
        result = fn(*args, **kwargs)
        # Every rank reads the norm, recording or not: for a DTensor this is a collective, and a rank
        # whose capture failed must still take part in it or the others would hang.
        self._guard(
            "capture",
            lambda: call.update(zip(("reported", "reported_local"), norm_results(result), strict=False)),
        )
        if self._recording:
            self._guard("capture", lambda: self._after_clip(call, fn, args, kwargs, result))
        return result

    def record(
        self,
        *,
        reported_norm: Any = None,
        clip_coef: Any = None,
        loss: Any = None,
        tokens: Any = None,
        loss_reduction: str | None = None,
    ) -> None:
        """Add what the training code logged (values given as numbers or one-element tensors)."""
        if loss_reduction is not None and loss_reduction not in ("mean", "sum"):
            raise CaptureError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        given = {
            "reported_norm": reported_norm,
            "clip_coef": clip_coef,
            "loss": loss,
            "tokens": check_tokens(tokens),
            "loss_reduction": loss_reduction,
        }
        self._logged.update({k: v for k, v in given.items() if v is not None})

    # -- recording ----------------------------------------------------------------------------

    def _before_clip(self, call: dict, first: bool) -> None:
        if first:
            self._snapshots.take("grad")
        call["unscaled"] = self._scaler.unscaled()
        call["loss_scale"] = self._scaler.scale()
        self._scaler.hold()

    def _after_clip(self, call: dict, fn, args, kwargs, result) -> None:
        if call["reported_local"] is not None:
            mesh = result.device_mesh
            self._norm_mesh = (
                tuple(int(r) for r in mesh.mesh.reshape(-1).tolist()),
                "+".join(axis_names(mesh)),
            )
        call["max_norm"], call["norm_type"] = clip_arguments(fn, args, kwargs)
        self._calls.append(call)
        self._snapshots.take("grad_clipped")

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        def record():
            self._stepped = True
            self._scaler.hold()
            if not self._calls:
                self._snapshots.take("grad_clipped")
            self._snapshots.take("param_before")

        self._guard("capture", record)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._guard("capture", lambda: self._snapshots.take("param_after"))

    def _finish(self) -> None:
        snapshots = self._snapshots
        if not snapshots.has("grad") and not snapshots.has("grad_clipped"):
            snapshots.take("grad", copy=False)  # written below, before training resumes
        if snapshots.abandoned is not None:
            # Better a missing rank (GA100) than a file that looks complete and is not.
            if self.strict:
                raise CaptureError(
                    f"gradaudit did not write rank {self.rank} of step {self.step}: {snapshots.abandoned}"
                )
            warn_once(
                "abandoned",
                f"gradaudit: rank {self.rank} writes no dump of step {self.step}: {snapshots.abandoned}",
            )
            return
        dump, tensors = build_rank_dump(
            snapshots,
            rank=self.rank,
            world_size=self.world_size,
            step=self.step,
            mode=self.mode,
            topology=self._topology(),
            aliases=self._ownership.aliases,
            clip=self._clip_record(),
            data=DataRecord(
                tokens=opt_int(self._logged.get("tokens")),
                loss=opt_float(self._logged.get("loss")),
                loss_reduction=self._logged.get("loss_reduction"),
            ),
            run_id=self.run_id,
        )
        try:
            self.path = write_dump(self.out_dir, dump, tensors)
        except DumpExistsError as exc:
            if self.strict:
                raise
            warn_once(
                f"exists:{self.out_dir}",
                f"gradaudit: not writing rank {self.rank} of step {self.step}: {exc}",
            )

    def _read_scaler_at_start(self) -> None:
        self._loss_scale = self._scaler.scale()
        self._scaler.hold()

    def _topology(self):
        topology = self._ownership.topology
        if self._norm_mesh is not None:
            ranks, name = self._norm_mesh
            topology = with_norm_group(topology, ranks, rank=self.rank, default=name)
        return topology

    def _clip_record(self) -> ClipRecord:
        calls = tuple(
            ClipCall(
                reported_norm=opt_float(c["reported"]),
                reported_local_norm=opt_float(c["reported_local"]),
                max_norm=opt_float(c["max_norm"]),
                norm_type=opt_float(c["norm_type"]),
                unscaled=c["unscaled"],
                loss_scale=c["loss_scale"],
            )
            for c in self._calls
        )
        reported = self._logged.get("reported_norm")
        if reported is None and calls:
            reported = calls[-1].reported_norm
        unscaled = [c.unscaled for c in calls if c.unscaled is not None]
        found_inf = self._scaler.found_inf()
        step_skipped = found_inf if found_inf is not None else (False if self._stepped else None)
        return ClipRecord(
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            reported_norm=opt_float(reported),
            clip_coef=opt_float(self._logged.get("clip_coef")),
            calls=calls,
            loss_scale=self._loss_scale,
            unscaled_before_clip=(all(unscaled) if unscaled else None),
            found_inf=found_inf,
            step_skipped=step_skipped,
        )

    # -- failures -------------------------------------------------------------------------------

    def _unsupported(self, param: str, exc: Exception) -> None:
        if self.strict:
            raise CaptureError(f"gradaudit cannot capture {param!r}: {exc}") from exc
        warn_once(
            f"param:{type(exc).__name__}",
            f"gradaudit: rank {self.rank} leaves out parameter {param!r} (and any other with the same problem): {exc}",
        )

    def _guard(self, what: str, action: Callable[[], None]) -> None:
        """Run a capture or write action; a failure warns once (or raises when strict), never breaks training."""
        try:
            action()
        except CaptureError:
            raise
        except Exception as exc:
            if self.strict:
                raise
            detail = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, OSError) and what == "write":
                detail = f"cannot write under {os.fspath(self.out_dir)!r} ({exc.strerror or exc})"
            warn_once(
                f"{what}:{type(exc).__name__}",
                f"gradaudit: rank {self.rank} could not {what} step {self.step}; training goes on without it. {detail}",
            )


def audit_step(model, out_dir, **kwargs) -> AuditStep:
    """Record one training step on this rank; the dump is written to out_dir/step_<step>/ on exit.

        with gradaudit.audit_step(model, "audit", step=step, max_norm=1.0, optimizer=opt) as audit:
            loss.backward()
            norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)
            opt.step()

    Keyword arguments:
      step, max_norm (required), norm_type (2.0): the optimizer step and the clipping the run means to do.
      optimizer: records parameters before/after its step (and the gradients it steps with when
        clipping was not done through `audit.clip`).
      scaler: a GradScaler: loss scale, whether unscale_ ran before each clip call, found_inf.
      groups: {name: ProcessGroup | rank list | list of rank lists}. 'tp' (or 'tensor_model_parallel')
        is the tensor-parallel group of Megatron-style parameters; 'dp' the group plain parameters are
        replicated over when no DDP wrapper says so; any other group is written to the topology.
      aliases: {this rank's parameter name: logical name}, e.g. {"lm_head.weight": "embed.weight"}.
      ownership: LocalPiece list for parameters the hook cannot infer (they replace its inference).
      mode: "full" (gradient values) or "stats" (float64 summaries computed where the tensors live);
        full_params: glob patterns of parameters whose values are kept in stats mode too.
      strict: raise instead of warning when capturing or writing fails.
      run_id: an identifier all ranks of the run share.
    """
    return AuditStep(model, out_dir, **kwargs)


def dump(
    model,
    out_dir,
    *,
    step: int,
    reported_norm: Any = None,
    clip_coef: Any = None,
    loss: Any = None,
    tokens: Any = None,
    loss_reduction: str | None = None,
    **kwargs: Any,
):
    """Write this rank's current gradients and the given metadata now (for step hooks and callbacks).

    Takes the arguments of `audit_step` and of `AuditStep.record`; returns the path written, or None.
    """
    if "optimizer" in kwargs:
        raise CaptureError("dump() records gradients as they are now; pass optimizer= to audit_step instead")
    session = AuditStep(model, out_dir, step=step, **kwargs)
    with session:
        session.record(
            reported_norm=reported_norm,
            clip_coef=clip_coef,
            loss=loss,
            tokens=tokens,
            loss_reduction=loss_reduction,
        )
    return session.path
