"""`audit_step`: the context that records one training step on this rank and writes its dump file."""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeAlias, TypeVar

from ..dumpfile.writer import DumpExistsError, rank_file_name, step_dir, write_rank_file
from ..errors import CaptureError
from ..model import MODES, ClipRecord, DataRecord, Mode, NotCapturedParam, TensorStats, Topology
from ..warn import warn_once
from . import intercept
from .arguments import (
    CallRecord,
    check_max_norm,
    check_norm_type,
    check_run_id,
    check_step,
    check_tokens,
    clips_nothing,
    norm_results,
    opt_float,
    rank_and_world_size,
)
from .callstats import grad_stats_of_snapshot, per_piece
from .infer import Ownership, infer_ownership
from .optimizers import hookable_optimizer
from .ownership import LocalPiece
from .scaler import ScalerWatch
from .snapshots import Snapshots, collection_paused
from .topology import axis_names, normalize_groups, with_norm_group
from .write import build_rank_dump, captured_pieces

if TYPE_CHECKING:
    from types import TracebackType

    import torch
    from torch.distributed import ProcessGroup
    from torch.utils.hooks import RemovableHandle

GroupSpec: TypeAlias = "ProcessGroup | Sequence[int] | Sequence[Sequence[int]]"
"""One entry of `groups=`: a process group, its rank list, or the list of all its rank lists."""

T = TypeVar("T")
P = ParamSpec("P")


class AuditStep:
    """Records one optimizer step on this rank; see `gradaudit.audit_step` for the arguments.

    Everything that can fail while capturing or writing warns once and lets training go on (unless
    `strict`); mistakes in the call itself raise CaptureError at once.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        out_dir: str | os.PathLike[str],
        *,
        step: int,
        max_norm: float | None = None,
        norm_type: float | str = 2.0,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        groups: Mapping[str, GroupSpec] | None = None,
        aliases: Mapping[str, str] | None = None,
        ownership: Sequence[LocalPiece] | None = None,
        mode: Mode = "full",
        full_params: Sequence[str] | str = (),
        strict: bool = False,
        run_id: str | int | None = None,
        steps: Iterable[int] | int | None = None,
        every: int | None = None,
        enabled: bool = True,
        capture_api: str = "audit_step",
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
        if ownership is not None and not all(isinstance(p, LocalPiece) for p in ownership):
            raise CaptureError("ownership= takes a list of gradaudit.capture.LocalPiece, one per local piece")
        self.optimizer = hookable_optimizer(optimizer)
        self.scaler = scaler
        self.mode = mode
        self.full_params = (full_params,) if isinstance(full_params, str) else tuple(full_params)
        self.strict = strict
        self.run_id = check_run_id(run_id)
        self.capture_api = capture_api
        """Recorded in the dump ("begin_audit", "dump", an integration's class name), so that the report's
        hints name the API the user called."""
        self.selected = _selected(self.step, steps=steps, every=every, enabled=enabled)
        """False when steps=/every=/enabled= leave this step out: the audit is then a no-op whose
        `clip` only calls the clipping function."""
        self.rank, self.world_size = rank_and_world_size()
        self._groups = normalize_groups(groups, world_size=self.world_size)
        self._aliases = dict(aliases or {})
        self._explicit = tuple(ownership or ())
        self._ownership: Ownership | None = None
        self._snapshots: Snapshots | None = None
        self._calls: list[CallRecord] = []
        self._call_stats: list[dict[int, TensorStats]] = []
        """Per finished clip call: piece index -> TensorStats of its gradient just before that call."""
        self._logged: dict[str, Any] = {}
        self._hooks: list[RemovableHandle] = []
        self._active = False
        self._skipped = False
        """Begun as a no-op: the step is left out, or its rank file already exists."""
        self._begun = False
        self._ended = False
        self._patched: list[Callable[[], None]] = []
        """Per intercept_clip, what puts the attribute back as it was (its own value, or none)."""
        self._interception: intercept.Handle | None = None
        """While the audit is open: the route of every clip call in the process to this audit."""
        self._stepped = False
        # GradScaler keys its state by the torch optimizer it steps (the one behind a wrapper).
        self._scaler = ScalerWatch(scaler, self.optimizer if self.optimizer is not None else optimizer)
        self._loss_scale: float | None = None
        self._norm_mesh: tuple[tuple[int, ...], str] | None = None
        """(ranks, name) of the mesh a DTensor norm returned by the clipping function was reduced over."""
        self.path: Path | None = None
        """Where the rank file was written (None until the context exits, or when writing failed)."""

    # -- begin and end (the context manager is built on them) ---------------------------------

    def begin(self) -> AuditStep:
        """Start recording: for callback frameworks, where one hook opens the audit and another ends it."""
        if self._begun:
            raise CaptureError(
                f"this audit of step {self.step} was already begun; make one AuditStep per optimizer step"
            )
        self._begun = True
        if not self.selected or self._dump_exists():
            self._skipped = self._active = True  # a no-op: clip() calls the function, end() writes nothing
            return self
        try:
            self._guard("capture", self._start)
            self._capture(self._read_scaler_at_start)
        except BaseException:
            self._remove_hooks()  # strict mode raised: leave nothing registered behind
            raise
        self._active = True
        self._guard("capture", self._intercept_clips)
        return self

    def _intercept_clips(self) -> None:
        self._interception = intercept.install(self._intercepted)

    def _intercepted(self, call: intercept.InterceptedCall) -> Any:
        """Record a clip call the training code made without audit.clip; return its own result."""
        outcome: list[Any] = []

        @functools.wraps(call.fn)
        def made(*args: Any, **kwargs: Any) -> Any:
            outcome.append(call())
            return call.reported_norm(outcome[0])

        value = call.argument("clip_value") if call.target.kind == "value" else None
        self._record_clip(made, call.args, call.kwargs, clip_value=value)
        return outcome[0]

    def _dump_exists(self) -> bool:
        """Whether this rank's file of the step is already there: warned about (or raised, when strict)
        when the audit opens, so that no capture is paid for a file that could not be written."""
        path = step_dir(self.out_dir, self.step) / rank_file_name(self.rank)
        if not path.exists():
            return False
        message = (
            f"{path}: a dump of rank {self.rank} for step {self.step} already exists; gradaudit never "
            "overwrites one. Remove it, or pass another out_dir"
        )
        warning = f"gradaudit: not capturing rank {self.rank} of step {self.step}: {message}"
        self._raise_or_warn(DumpExistsError(message), f"exists:{path}", warning)
        return True

    def end(self) -> Path | None:
        """Stop recording and write this rank's file; returns its path (None when nothing was written).

        Call it after the optimizer step (or, with no optimizer given, whenever the gradients are final)."""
        self._close()
        if self._recording and not self._ended:
            self._ended = True
            self._guard("write", self._finish)
        return self.path

    def cancel(self) -> None:
        """Stop recording and write nothing (the step failed, or the framework skipped it)."""
        self._close()
        self._ended = True

    def _close(self) -> None:
        if not self._begun:
            raise CaptureError(f"this audit of step {self.step} was never begun; call begin() first")
        self._active = False
        if self._interception is not None:
            self._interception.remove()
            self._interception = None
        self._remove_hooks()
        for put_back in reversed(self._patched):
            put_back()
        self._patched.clear()

    def __enter__(self) -> AuditStep:
        return self.begin()

    def _start(self) -> None:
        uninferred: dict[str, NotCapturedParam] = {}
        ownership = infer_ownership(
            self.model,
            rank=self.rank,
            world_size=self.world_size,
            groups=self._groups,
            aliases=self._aliases,
            explicit=self._explicit,
            on_unsupported=functools.partial(self._uninferred, uninferred),
        )
        snapshots = Snapshots(
            ownership.pieces,
            mode=self.mode,
            norm_type=self.norm_type,
            full_params=self.full_params,
            on_error=self._unsupported,
            left_out=tuple(uninferred.values()),
        )
        if self.optimizer is not None:
            self._hooks.append(self.optimizer.register_step_pre_hook(lambda *_: self.before_optimizer_step()))
            self._hooks.append(self.optimizer.register_step_post_hook(lambda *_: self.after_optimizer_step()))
        self._ownership, self._snapshots = ownership, snapshots

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    @property
    def _recording(self) -> bool:
        """False when the capture could not start: the step then runs exactly as without gradaudit."""
        return self._snapshots is not None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.cancel()  # the step itself failed: its exception matters, not a half-recorded dump
        else:
            self.end()

    # -- what training code calls -------------------------------------------------------------

    def clip(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call `fn(*args, **kwargs)` and return what it returns, recording gradients around it."""
        if not self._active:
            raise CaptureError(
                "audit.clip() was called outside its audit; call it inside `with gradaudit.audit_step(...)`, "
                "or between audit.begin() and audit.end()"
            )
        # Inside: part of a clip call being recorded (torch's clip inside a framework's).
        if self._skipped or intercept.inside():
            return fn(*args, **kwargs)
        return intercept.recorded(
            self._interception, fn, args, kwargs, lambda: self._record_clip(fn, args, kwargs)
        )

    def _record_clip(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], clip_value: Any = None
    ) -> Any:
        if clips_nothing(fn, args, kwargs):
            return fn(*args, **kwargs)  # reads the norm, clips nothing: not a clip call
        before = self._capture(self._before_clip)
        result = fn(*args, **kwargs)
        # Every rank reads the norm, recording or not: for a DTensor this is a collective, and a rank
        # whose capture failed must still take part in it or the others would hang.
        returned = self._guard("capture", lambda: norm_results(result))
        measured = {"clip_value": clip_value, **(before or {})}
        self._capture(lambda: self._after_clip(CallRecord.of(fn, args, kwargs, returned, **measured), result))
        return result

    @property
    def reported_norms(self) -> tuple[float | None, ...]:
        """The norm each clip call so far returned, in call order (None where it returned none)."""
        return tuple(opt_float(c.reported) for c in self._calls)

    def intercept_clip(self, owner: Any, name: str) -> None:
        """Route every call of `owner.<name>(...)` through `audit.clip` until the audit ends.

        For frameworks that clip inside their own loop, e.g. `audit.intercept_clip(accelerator,
        "clip_grad_norm_")`; the attribute is restored by end() or cancel()."""
        if not self._active:
            raise CaptureError("intercept_clip() needs a begun audit; call audit.begin() first")
        if self._skipped:
            return
        original = getattr(owner, name)
        own = vars(owner) if hasattr(owner, "__dict__") else {}
        restore = functools.partial(setattr, owner, name, own[name]) if name in own else None
        self._patched.append(restore or functools.partial(delattr, owner, name))  # its own, or none

        @functools.wraps(original)
        def clip(*args: Any, **kwargs: Any) -> Any:
            return self.clip(original, *args, **kwargs)

        setattr(owner, name, clip)

    def record(
        self,
        *,
        reported_norm: float | torch.Tensor | None = None,
        clip_coef: float | torch.Tensor | None = None,
        loss: float | torch.Tensor | None = None,
        tokens: int | float | torch.Tensor | None = None,
        loss_reduction: Literal["mean", "sum"] | None = None,
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

    def _taken(self) -> Snapshots:
        """The snapshots of a recording audit (only called while `_recording`)."""
        snapshots = self._snapshots
        assert snapshots is not None
        return snapshots

    def _before_clip(self) -> dict[str, Any]:
        """Snapshot the gradients the call is about to clip; the scaler's `unscaled` and `loss_scale` now."""
        if self._calls:
            # Summarize the previous call's pre-clip snapshot before it is replaced: with one call
            # (the common case) no statistics beyond the dump's own are ever computed.
            self._call_stats.append(grad_stats_of_snapshot(self._taken()))
        self._taken().take("grad")
        scaler = {"unscaled": self._scaler.unscaled(), "loss_scale": self._scaler.scale()}
        self._scaler.hold()
        return scaler

    def _after_clip(self, call: CallRecord, result: Any) -> None:
        if call.reported_local is not None:
            mesh = result.device_mesh
            self._norm_mesh = (
                tuple(int(r) for r in mesh.mesh.reshape(-1).tolist()),
                "+".join(axis_names(mesh)),
            )
        self._calls.append(call)
        self._taken().take("grad_clipped")

    def take_gradients(self, *, clipped: bool) -> None:
        """Record the gradients as they are now: before clipping (clipped=False) or as the optimizer will
        step with them (clipped=True). For clipping done in user code that no call can wrap, e.g. ZeRO
        gradients clipped by hand between DeepSpeed's `engine.backward` and `engine.step`."""
        self._capture(lambda: self._taken().take("grad_clipped" if clipped else "grad"))

    def before_optimizer_step(self) -> None:
        """Record the parameters the optimizer step starts from (and, when clipping did not go through
        `audit.clip`, the gradients it steps with). The `optimizer=` hooks call this; a framework whose
        closure runs inside `optimizer.step()` calls it itself once the gradients are final."""

        def record() -> None:
            self._stepped = True
            self._scaler.hold()
            if not self._calls:
                # No clip call was recorded: these are the gradients the step uses, and (unless
                # take_gradients recorded them earlier) the only ones the audit sees at all.
                self._taken().take("grad_clipped")
                if not self._taken().has("grad"):
                    self._taken().take("grad")
            self._taken().take("param_before")

        self._capture(record)

    def after_optimizer_step(self) -> None:
        """Record the parameters after the optimizer step (the `optimizer=` hooks call this)."""
        self._capture(lambda: self._taken().take("param_after"))

    def _finish(self) -> None:
        snapshots = self._taken()
        if not snapshots.has("grad") and not snapshots.has("grad_clipped"):
            snapshots.take("grad", copy=False)  # written below, before training resumes
        if snapshots.abandoned is not None:
            # Better a missing rank (GA100) than a file that looks complete and is not.
            error = CaptureError(
                f"gradaudit did not write rank {self.rank} of step {self.step}: {snapshots.abandoned}"
            )
            warning = f"gradaudit: rank {self.rank} writes no dump of step {self.step}: {snapshots.abandoned}"
            self._raise_or_warn(error, "abandoned", warning)
            return
        if self._call_stats:  # the last of two or more calls (one call's would be dropped)
            self._call_stats.append(grad_stats_of_snapshot(snapshots))
        params, pieces, tensors = captured_pieces(
            snapshots, mode=self.mode, call_stats=per_piece(self._call_stats, len(snapshots.pieces))
        )
        dump = build_rank_dump(
            rank=self.rank,
            world_size=self.world_size,
            step=self.step,
            mode=self.mode,
            params=params,
            pieces=pieces,
            topology=self._topology(),
            aliases=self._owned().aliases,
            clip=self._clip_record(),
            data=DataRecord(
                tokens=self._logged.get("tokens"),  # an int: record() checked it
                loss=opt_float(self._logged.get("loss")),
                loss_reduction=self._logged.get("loss_reduction"),
            ),
            run_id=self.run_id,
            capture_api=self.capture_api,
            not_captured=tuple(snapshots.not_captured[name] for name in sorted(snapshots.not_captured)),
        )
        try:
            with collection_paused():  # a full dump's document is several objects per piece
                self.path = write_rank_file(step_dir(self.out_dir, self.step), dump, tensors)
        except DumpExistsError as exc:
            warning = f"gradaudit: not writing rank {self.rank} of step {self.step}: {exc}"
            self._raise_or_warn(exc, f"exists:{self.out_dir}", warning)

    def _read_scaler_at_start(self) -> None:
        self._loss_scale = self._scaler.scale()
        self._scaler.hold()

    def _owned(self) -> Ownership:
        """The ownership a recording audit inferred at its start (only called while `_recording`)."""
        ownership = self._ownership
        assert ownership is not None
        return ownership

    def _topology(self) -> Topology:
        topology = self._owned().topology
        if self._norm_mesh is not None:
            ranks, name = self._norm_mesh
            topology = with_norm_group(topology, ranks, rank=self.rank, default=name)
        return topology

    def _clip_record(self) -> ClipRecord:
        calls = tuple(c.clip_call() for c in self._calls)
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

    def _raise_or_warn(self, error: Exception, key: str, warning: str) -> None:
        """Raise `error` when strict; else warn once (per `key`) and let training go on."""
        if self.strict:
            raise error
        warn_once(key, warning)

    def _unsupported(self, param: str, exc: Exception) -> None:
        if self.strict:
            raise CaptureError(f"gradaudit cannot capture {param!r}: {exc}") from exc
        warn_once(
            f"param:{type(exc).__name__}",
            f"gradaudit: rank {self.rank} leaves out parameter {param!r} (and any other with the same problem): {exc}",
        )

    def _uninferred(self, left_out: dict[str, NotCapturedParam], param: str, exc: Exception) -> None:
        """A parameter whose ownership cannot be inferred: warned about, and listed in the dump as not
        captured (GA104), so the report says its gradient is in no norm rather than omitting it silently."""
        self._unsupported(param, exc)
        left_out.setdefault(param, NotCapturedParam(name=param, reason=f"ownership not inferred: {exc}"))

    def _capture(self, action: Callable[[], T]) -> T | None:
        """Run a capture action when recording, as `_guard` runs it; None when not recording."""
        return self._guard("capture", action) if self._recording else None

    def _guard(self, what: str, action: Callable[[], T]) -> T | None:
        """Run a capture or write action and return its result; a failure warns once (or raises when
        strict) and gives None, never breaks training."""
        try:
            return action()
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
            return None


def _selected(step: int, *, steps: Iterable[int] | int | None, every: int | None, enabled: bool) -> bool:
    """Whether `step` is audited: enabled, and in steps= or a multiple of every= (all steps when neither)."""
    if not isinstance(enabled, bool):
        raise CaptureError(f"enabled= must be True or False, got {enabled!r}")
    if steps is None and every is None:
        return enabled
    from .steps import select_steps

    return enabled and select_steps(steps, every).wants(step)


def _takes_arguments_of(source: Callable[P, Any]) -> Callable[[Callable[..., T]], Callable[P, T]]:
    """Give the decorated function the parameters of `source`, for type checkers and for
    `inspect.signature` alike: the capture API's keyword arguments are written once."""

    def decorate(fn: Callable[..., T]) -> Callable[P, T]:
        fn.__signature__ = inspect.signature(source)  # type: ignore[attr-defined]
        return fn

    return decorate


def audit_step(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    step: int,
    max_norm: float | None = None,
    norm_type: float | str = 2.0,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    groups: Mapping[str, GroupSpec] | None = None,
    aliases: Mapping[str, str] | None = None,
    ownership: Sequence[LocalPiece] | None = None,
    mode: Mode = "full",
    full_params: Sequence[str] | str = (),
    strict: bool = False,
    run_id: str | int | None = None,
    steps: Iterable[int] | int | None = None,
    every: int | None = None,
    enabled: bool = True,
) -> AuditStep:
    """Record one training step on this rank; the dump is written to out_dir/step_<step>/ on exit.

        with gradaudit.audit_step(model, "audit", step=step, max_norm=1.0, optimizer=opt) as audit:
            loss.backward()
            norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)
            opt.step()

    Keyword arguments:
      step: the optimizer step, a non-negative int (required).
      max_norm: the clipping threshold the run means to use (required; None raises CaptureError).
      norm_type: `p` of the norm, 2.0 by default; inf or "inf" for the max norm.
      optimizer: records parameters before/after its step (and the gradients it steps with when
        clipping was not done through `audit.clip`); a framework's wrapper exposing the torch
        optimizer as `.optimizer` (Accelerate, HF Trainer, Lightning) is unwrapped.
      scaler: a GradScaler: loss scale, whether unscale_ ran before each clip call, found_inf.
      groups: {name: ProcessGroup | rank list | list of rank lists}. 'tp' (or 'tensor_model_parallel')
        is the tensor-parallel group of Megatron-style parameters; 'dp' the group plain parameters are
        replicated over when no DDP wrapper says so; any other group is written to the topology.
      aliases: {this rank's parameter name: logical name}, e.g. {"lm_head.weight": "embed.weight"}.
      ownership: LocalPiece list for parameters the hook cannot infer (they replace its inference).
      mode: "full" (gradient values, the default) or "stats" (float64 summaries computed where the
        tensors live).
      full_params: glob patterns (or one pattern) of parameters whose values are kept in stats mode too.
      strict: raise instead of warning when capturing or writing fails (False by default).
      run_id: an identifier all ranks of the run share (an integer job id is written as its digits).
      steps, every, enabled: which steps are audited (steps=[100, 200], every=100, enabled=flag); on
        any other step the audit is a no-op and `audit.clip(fn, ...)` only calls fn. A step whose rank
        file already exists is not captured either (a warning says so when the audit opens).

        for step in range(1, num_steps + 1):
            with gradaudit.audit_step(model, "audit", step=step, max_norm=1.0, every=100) as audit:
                ...
    """
    return AuditStep(**locals())  # every parameter above, as given


@_takes_arguments_of(audit_step)
def begin_audit(*args: Any, **kwargs: Any) -> AuditStep:
    """Begin recording one training step now; `audit.end()` writes the dump (the begin/end form of
    `audit_step`, for callback frameworks where one hook opens the audit and a later one closes it).

        audit = gradaudit.begin_audit(model, "audit", step=step, max_norm=1.0, optimizer=opt)
        ...  # backward; audit.clip(...) or audit.intercept_clip(owner, "clip_grad_norm_"); opt.step()
        audit.end()

    The keyword arguments are `audit_step`'s, with the same meanings and defaults. `optimizer=` may be a
    framework's wrapper that exposes the torch optimizer as `.optimizer` (Accelerate, HF Trainer,
    Lightning).
    """
    return AuditStep(*args, **kwargs, capture_api="begin_audit").begin()


def dump(
    model: torch.nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    step: int,
    max_norm: float | None = None,
    norm_type: float | str = 2.0,
    scaler: torch.amp.GradScaler | None = None,
    groups: Mapping[str, GroupSpec] | None = None,
    aliases: Mapping[str, str] | None = None,
    ownership: Sequence[LocalPiece] | None = None,
    mode: Mode = "full",
    full_params: Sequence[str] | str = (),
    strict: bool = False,
    run_id: str | int | None = None,
    steps: Iterable[int] | int | None = None,
    every: int | None = None,
    enabled: bool = True,
    reported_norm: float | torch.Tensor | None = None,
    clip_coef: float | torch.Tensor | None = None,
    loss: float | torch.Tensor | None = None,
    tokens: int | float | torch.Tensor | None = None,
    loss_reduction: Literal["mean", "sum"] | None = None,
    optimizer: None = None,
) -> Path | None:
    """Write this rank's current gradients and the given metadata now (for step hooks and callbacks).

    Takes `audit_step`'s keyword arguments (same meanings and defaults) except `optimizer`, which raises
    CaptureError: a dump records the gradients as they are now, not around an optimizer step. And what
    the training code logged, as numbers or one-element tensors (as `AuditStep.record` takes them):
      reported_norm: the total norm the training code logged or its clip function returned.
      clip_coef: the clipping coefficient the training code says it applied.
      loss, tokens: this rank's loss and number of tokens.
      loss_reduction: "mean" when the rank averaged its loss over its own tokens, "sum" otherwise.
    Returns the path written, or None.

    Call it where the gradients are final and not yet clipped: after the last backward of the step,
    before the clip call. In a hand-written loop that is just before `clip_grad_norm_`; in Lightning,
    `on_before_optimizer_step` (it runs before Lightning clips); in Accelerate, just before
    `accelerator.clip_grad_norm_`. HF Trainer has no callback between backward and clipping (its
    `on_pre_optimizer_step` runs after it clipped): use `gradaudit.integrations.transformers.
    GradAuditCallback` there, and the other framework modules in `gradaudit.integrations` elsewhere. A
    dump taken after clipping holds gradients whose norm is max_norm itself; the report names it GA503.
    """
    if optimizer is not None:
        raise CaptureError("dump() records gradients as they are now; pass optimizer= to audit_step instead")
    given = locals()
    recorded = {
        name: given.pop(name) for name in ("reported_norm", "clip_coef", "loss", "tokens", "loss_reduction")
    }
    session = AuditStep(**given, capture_api="dump")
    with session:
        session.record(**recorded)
    return session.path
