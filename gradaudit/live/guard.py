"""`gradaudit.guard`: check every step's clipping while training runs, with one all-gather per checked
step, and dump the step that goes wrong."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import CaptureError, GradauditError
from ..model import Topology
from ..version import __version__
from .analysis_input import SHARDED, LiveStep, RankSummary, rank_dumps, report_of
from .summary import (
    FAILED,
    CallRecord,
    LocalSummary,
    VectorLayout,
    coefficient,
    failed_vector,
    group_key,
    ownership_groups,
    pack,
)
from .trend import TREND_FILE, TrendLine, by_last_call, skipped_line, trend_line

if TYPE_CHECKING:
    from types import TracebackType

    import torch
    from torch.utils.hooks import RemovableHandle

    from ..capture.ownership import LocalPiece
    from ..capture.session import AuditStep
    from ..report.model import Report

OnAnomaly = Literal["warn", "raise"]
ON_ANOMALY = ("warn", "raise")
TRIGGER = "guard"
"""The dump metadata's `trigger` for a step the guard wrote on an anomaly."""


class GuardAnomaly(GradauditError):
    """The guard found the clipping of a step wrong (on_anomaly="raise"); raised on every rank alike."""

    def __init__(self, message: str, *, step: int, codes: tuple[str, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.codes = codes


class GuardWarning(UserWarning):
    """One anomaly the guard found (on_anomaly="warn"), or the guard switching itself off."""


class Guard:
    """Check the clipping of every training step from now on; attach once, before the loop.

        gradaudit.guard(model, max_norm=1.0, optimizer=opt, out_dir="audit")
        for batch in loader:
            loss(model(batch)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad()

    The guard sees every clip call (torch.nn.utils.clip_grad_norm_ and FSDP1's) and the optimizer step
    by itself. Per checked step each rank sums its gradients' norms per ownership group on their
    device, and one all-gather of a small float64 vector gives every rank the same verdict, reached by
    the analysis `gradaudit check` runs. A step whose clipping is wrong is named in a warning (or a
    GuardAnomaly on every rank with on_anomaly="raise"), written as a dump `gradaudit check` reads, and
    the next step is captured in full under out_dir/full/. Rank 0 appends one line per checked step to
    out_dir/guard_trend.jsonl.

    Keyword arguments: max_norm, optimizer, out_dir (all three required), norm_type, groups, aliases:
      as `audit_step` takes them; scaler: the torch.amp.GradScaler of fp16 training (the loss scale and
      whether unscale_ ran before the clip are accounted for, and a step the scaler skips for inf
      gradients is written to the trend as skipped, not as an anomaly); every: check every N-th step;
      on_anomaly ("warn" or "raise"); max_dumps (3) and cooldown (100 steps): at most that many dumps, that many
      steps apart; late (on GPU by default): read each verdict at the next step, so that the check adds
      no host sync; first_step (1): the number of the first optimizer step; capture_next (True);
      on_verdict: called on every rank with each checked step's TrendLine (to log the true norm);
      ownership: this rank's pieces, when they are not the model's parameters (DeepSpeed ZeRO).
    `guard.remove()` stops it; `with gradaudit.guard(...):` removes it on exit.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_norm: float,
        optimizer: Any = None,
        out_dir: str | os.PathLike[str],
        norm_type: float | str = 2.0,
        groups: Mapping[str, Any] | None = None,
        aliases: Mapping[str, str] | None = None,
        scaler: Any = None,
        every: int = 1,
        on_anomaly: OnAnomaly = "warn",
        max_dumps: int = 3,
        cooldown: int = 100,
        late: bool | None = None,
        first_step: int = 1,
        run_id: str | None = None,
        capture_next: bool = True,
        on_verdict: Callable[[TrendLine], None] | None = None,
        ownership: Sequence[LocalPiece] | None = None,
    ) -> None:
        from ..capture.arguments import check_max_norm, check_norm_type, check_run_id, rank_and_world_size
        from ..capture.optimizers import hookable_optimizer
        from ..capture.scaler import ScalerWatch
        from ..capture.topology import normalize_groups

        self.max_norm = check_max_norm(max_norm)
        self.norm_type = check_norm_type(norm_type)
        if on_anomaly not in ON_ANOMALY:
            raise CaptureError(f"on_anomaly must be 'warn' or 'raise', got {on_anomaly!r}")
        for name, value, least in (
            ("every", every, 1),
            ("max_dumps", max_dumps, 0),
            ("cooldown", cooldown, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise CaptureError(f"{name} must be an integer of at least {least}, got {value!r}")
        self.optimizer = hookable_optimizer(optimizer)
        if self.optimizer is None:
            raise CaptureError(
                "gradaudit.guard needs optimizer= (the optimizer whose step ends each training step)"
            )
        self.model = model
        self.out_dir = Path(out_dir)
        self.every = every
        self.on_anomaly = on_anomaly
        self.max_dumps = max_dumps
        self.cooldown = cooldown
        self.scaler = scaler
        self._scaler = ScalerWatch(scaler, self.optimizer) if scaler is not None else None
        self._scale_at_clip: tuple[float | None, bool | None] | None = None
        """(loss scale, whether unscale_ had run) at the latest clip call of the step; and at its first:"""
        self._scale_at_first_clip: tuple[float | None, bool | None] | None = None
        self._call_unscales = 1.0
        """The loss scale the clip call under way divides out itself (see `clip_unscaling`)."""
        self._stepped = False
        self._grad_dtype: str | None = None
        self.run_id = check_run_id(run_id)
        self.capture_next = capture_next
        self.on_verdict = on_verdict
        self.last: TrendLine | None = None
        """The latest checked step's line of the trend (every rank has it)."""
        self.rank, self.world_size = rank_and_world_size()
        self._groups = normalize_groups(groups, world_size=self.world_size)
        self._aliases = dict(aliases or {})
        self._ownership = None if ownership is None else tuple(ownership)
        self.step = first_step
        """The optimizer step now under way (counted by the optimizer's step hook)."""
        self.anomalies: list[tuple[int, tuple[str, ...]]] = []
        """(step, codes) of every anomaly found so far."""
        self.dumps: list[Path] = []
        self.active = False
        self._late = late
        self._hooks: list[RemovableHandle] = []
        self._interception: Any = None
        self._calls: list[CallRecord] = []
        self._num_calls = 0
        self._pending: tuple[int, Any, Any] | None = None
        self._last_dump_step: int | None = None
        self._capture: AuditStep | None = None
        self._capture_step: int | None = None
        self._trend_file: Any = None
        self._paused = False
        self._attach()

    # -- attaching and removing -----------------------------------------------------------------

    def _attach(self) -> None:
        from ..capture.infer import infer_ownership
        from ..warn import warn_once

        def unsupported(param: str, exc: Exception) -> None:
            warn_once(
                f"guard:{param}", f"gradaudit guard: parameter {param!r} is left out of every check: {exc}"
            )

        ownership = infer_ownership(
            self.model if self._ownership is None else _no_parameters(),  # given pieces: nothing to infer
            explicit=self._ownership or (),
            rank=self.rank,
            world_size=self.world_size,
            groups=self._groups,
            aliases=self._aliases,
            on_unsupported=unsupported,
        )
        mine = [
            (p.param, p.regions if math.prod(p.local_shape) else None, group_key(p), p.dtype)
            for p in ownership.pieces
        ]
        every_rank = self._exchange_once((mine, ownership.topology))
        keys_of, added = _ownership_keys([pieces for pieces, _ in every_rank])
        keys = keys_of[self.rank]
        dtype_of: dict[str, str] = {}
        for (pieces, _), rank_keys in zip(every_rank, keys_of, strict=True):
            for (*_, dtype), key in zip(pieces, rank_keys, strict=True):
                dtype_of.setdefault(key, dtype)
        self.groups = ownership_groups([k for rank_keys in keys_of for k in rank_keys], dtype_of)
        position = {g.name: i for i, g in enumerate(self.groups)}
        self._held = [tuple(g.name in rank_keys for g in self.groups) for rank_keys in keys_of]
        self._topologies: list[Topology] = [
            dataclasses.replace(topology, groups={**topology.groups, **added}) if added else topology
            for _, topology in every_rank
        ]
        self.layout = VectorLayout(num_groups=len(self.groups))
        self._summary = LocalSummary(
            ownership.pieces, [position[k] for k in keys], self.layout, self.norm_type, model=self.model
        )
        self._device = _device_of(self.model)
        if self._late is None:
            self._late = self._device.type != "cpu"
        self._install()
        self.active = True

    def pause(self) -> None:
        """Check no step until `resume()`: the steps in between are neither measured nor gathered,
        and still counted, so the guard's step numbers stay the optimizer's (every rank must pause and
        resume at the same steps, or the ranks' collectives would not match)."""
        if self.active and self._pending is not None:
            self._read_pending()
        self._paused = True

    def resume(self) -> None:
        """Check again from the next step, as before `pause()`."""
        self._paused = False

    def _install(self) -> None:
        assert self.optimizer is not None  # checked in __init__
        self._hooks.append(self.optimizer.register_step_pre_hook(self._before_step))
        self._hooks.append(self.optimizer.register_step_post_hook(self._after_step))
        from ..capture import intercept

        self._interception = intercept.install(self._intercepted)
        if self.scaler is not None:
            self.scaler.step = self._scaler_step  # an instance attribute: removing it restores the class's

    def _uninstall(self) -> None:
        if self._interception is not None:
            self._interception.remove()
            self._interception = None
        if self.scaler is not None and vars(self.scaler).get("step") == self._scaler_step:
            del self.scaler.step

    def _scaler_step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """GradScaler.step, seen by the guard: a step the scaler skips (inf gradients, so the optimizer's
        hooks never run) still ends the guard's step, and is checked as skipped."""
        assert self.scaler is not None
        self._stepped = False
        result = type(self.scaler).step(self.scaler, optimizer, *args, **kwargs)
        if not self._stepped and self.active:
            self._end_of_step(skipped=True)
        return result

    def _exchange_once(self, mine: Any) -> list[Any]:
        """Every rank's ownership groups and topology, once when the guard is attached."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return [mine]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return gathered

    def remove(self) -> None:
        """Stop checking (after reading a verdict still pending); the model and optimizer are left as they were."""
        try:
            if self.active and self._pending is not None:
                self._read_pending()
        finally:
            self._switch_off()
            if self._trend_file is not None:
                self._trend_file.close()
                self._trend_file = None

    def _switch_off(self) -> None:
        self.active = False
        self._uninstall()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._capture is not None:
            self._capture.cancel()
            self._capture = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self._pending = None  # the training failed: its exception matters, not the last verdict
        self.remove()

    # -- inside the step ------------------------------------------------------------------------

    @property
    def _checked(self) -> bool:
        # A step captured in full is not checked live: the capture's own route sees its clip calls
        # (the newest route gets them), and `gradaudit check` of its dump says what went wrong.
        return self.active and not self._paused and self._capture is None and self.step % self.every == 0

    def _intercepted(self, call: Any) -> Any:
        """Every clip call in the process (capture/intercept.py): measured around, made once."""
        made: list[Any] = []

        def make(*args: Any, **kwargs: Any) -> Any:
            made.append(call())
            return call.reported_norm(made[0])

        self._measured(make, call.args, call.kwargs, fn_for_arguments=call.fn)
        return made[0]

    def _measured(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        fn_for_arguments: Callable[..., Any] | None = None,
    ) -> Any:
        """Call fn; on a checked step, record the gradient's group norms and sample around the call.
        `fn` returns the norm the call clipped with."""
        if not self._checked:
            return fn(*args, **kwargs)
        before = self._safely(self._before_call)
        result = fn(*args, **kwargs)
        if before is not None and self.active:
            self._safely(lambda: self._record_call(before, fn_for_arguments or fn, args, kwargs, result))
        return result

    def clip(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a clipping function the guard does not see by itself (your own, returning the norm it
        clipped with) and return what it returns; the guard records it as a clip call of the step."""
        from ..capture import intercept

        if self._capture is not None:  # a step captured in full: the capture records the call
            return self._capture.clip(fn, *args, **kwargs)
        if intercept.inside():
            return fn(*args, **kwargs)
        with intercept.outermost():
            return self._measured(fn, args, kwargs)

    def clip_unscaling(self, loss_scale: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`clip` of a call that divides the gradients by the loss scale they carry before its norm (DeepSpeed's
        `engine.step()` under fp16): what the guard measures before the call is divided by it too."""
        self._call_unscales = loss_scale
        try:
            return self.clip(fn, *args, **kwargs)
        finally:
            self._call_unscales = 1.0

    def applied(self, coef: Any) -> None:
        """The coefficient the step's latest clip call applied, measured by an integration where the
        guard's sample after the call cannot be read (ZeRO frees its gradient partitions in the step)."""
        if self._calls:
            self._calls[-1].coef = coef

    def _before_call(self) -> tuple[Any, Any, Any, bool | None]:
        terms, sample, sampled = self._summary.measure()
        unscaled = self._scaler.unscaled() if self._scaler is not None else None
        return terms, sample, sampled, unscaled

    def _record_call(
        self,
        before: tuple[Any, Any, Any, bool | None],
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        result: Any,
    ) -> None:
        from ..capture.arguments import clip_arguments, norm_results

        terms, sample, sampled, unscaled_before = before
        if self._scaler is not None:
            self._scale_at_clip = (self._scaler.scale(), self._scaler.unscaled())
            self._scale_at_first_clip = self._scale_at_first_clip or self._scale_at_clip
            scale, unscaled = self._scale_at_clip
            if unscaled_before is False and unscaled and scale:
                # the call unscaled the gradients before its norm (accelerator.clip_grad_norm_ does):
                # what was measured before it is divided by the loss scale, as the call saw it
                terms, sample = _unscaled(terms, sample, scale, self.norm_type, self.layout.num_groups)
        elif self._call_unscales != 1.0:
            terms, sample = _unscaled(
                terms, sample, self._call_unscales, self.norm_type, self.layout.num_groups
            )
        max_norm, norm_type = clip_arguments(fn, args, kwargs)
        record = CallRecord(
            terms=terms,
            reported=norm_results(result)[0],
            max_norm=max_norm,
            norm_type=norm_type,
            coef=None,  # measured once, at the optimizer step (see _vector), unless `applied` says it
            before=sample,
            sampled=sampled,
        )
        self._num_calls += 1
        if len(self._calls) < self.layout.max_calls:
            self._calls.append(record)
        else:
            self._calls[-1] = record

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._pending is not None:
            self._read_pending()  # a GuardAnomaly raised here stops every rank before this step
        if self._capture is not None:
            self._capture.before_optimizer_step()

    def _vector(self, *, skipped: bool) -> Any:
        if self._calls:
            last = self._calls[-1]
            # the same gradient tensors the last call clipped in place, sampled again (or what an
            # integration measured where they are gone by now, see `applied`)
            applied = (
                last.coef
                if last.coef is not None
                else coefficient(last.before, self._summary.sample(last.sampled))
            )
            terms = last.terms
        else:
            terms, applied = self._summary.terms(), 1.0  # no clip call: the optimizer steps with these
        scaler: tuple[float | None, bool | None, bool | None] = (None, None, None)
        if self._scaler is not None:
            scale, unscaled = self._scale_at_first_clip or (self._scaler.scale(), None)
            scaler = (scale, unscaled, skipped)
            last_scale, last_unscaled = self._scale_at_clip or (None, None)
            if last_unscaled is False and last_scale and not skipped:
                # scaler.step unscaled the gradients after the clip: the sample at the step shows the
                # clip's coefficient divided by the loss scale
                applied = applied * last_scale
        if self._grad_dtype is None:  # once: read from the gradients' metadata, no pass over them
            self._grad_dtype = _loosest_dtype(p.grad() for p in self._summary.pieces)
        return pack(
            self.layout,
            device=self._device,
            terms=terms,
            applied_coef=applied,
            calls=self._calls,
            num_calls=self._num_calls,
            scaler=scaler,
            grad_dtype=self._grad_dtype,
        )

    def _gather(self, vector: Any) -> None:
        import torch
        import torch.distributed as dist

        try:
            if self._pending is not None:
                self._read_pending()  # a step the scaler skipped has no optimizer pre-hook to read it
            if self.world_size > 1:
                gathered = torch.empty(
                    self.world_size * vector.numel(), dtype=vector.dtype, device=vector.device
                )
                # all_gather_single is all_gather_into_tensor's newer name (the old one warns from torch 2.13)
                gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather_single(gathered, vector)
            else:
                gathered = vector
            if self._late:
                host = gathered.to("cpu", non_blocking=True)
                event = None
                if gathered.device.type == "cuda":
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record()
                self._pending = (self.step, host, event)
            else:
                self._pending = (self.step, gathered, None)
                self._read_pending()
        except GuardAnomaly:
            raise
        except Exception as exc:  # noqa: BLE001  a failing collective switches the guard off, not training
            self._fail(exc)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # The summary is sent after the step, not before: a closure (Lightning, LBFGS) runs the backward
        # and the clip inside optimizer.step(); optimizers leave the gradients as they were.
        self._stepped = True
        self._end_of_step(skipped=False)

    def _end_of_step(self, *, skipped: bool) -> None:
        if self._checked:
            vector = self._safely(lambda: self._vector(skipped=skipped))
            if vector is None and self.active:
                vector = failed_vector(self.layout, self._device)
            if vector is not None:
                try:
                    self._gather(vector)
                except GuardAnomaly:
                    self._end_step()
                    raise
        self._end_step()

    def _end_step(self) -> None:
        capture = self._capture
        if capture is not None:
            self._capture = None
            self._safely(lambda: _end_capture(capture))
        self._calls, self._num_calls = [], 0
        self._scale_at_clip = self._scale_at_first_clip = None
        self.step += 1
        if self._capture_step is not None and self.active and not self._paused:
            self._safely(self._begin_capture)

    # -- the verdict -----------------------------------------------------------------------------

    def _read_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        step, gathered, event = pending
        if event is not None:
            event.synchronize()
        rows = gathered.cpu().numpy().reshape(self.world_size, self.layout.size)
        if (rows[:, 0] == FAILED).any():
            failed = [r for r in range(self.world_size) if rows[r, 0] == FAILED]
            self._warn(f"gradaudit guard: rank(s) {failed} could not measure step {step}; the guard is off")
            self._switch_off()
            return
        live = self._safely(lambda: self.live_step(step, rows))
        if live is not None and all(r.skipped for r in live.ranks.values()):
            self._record_line(skipped_line(live))  # the optimizer did not step: nothing was clipped
        elif live is not None:
            report = self._safely(lambda: report_of(live))
            if report is not None:
                self._judge(step, (live, report))

    def line_of(self, step: int, *, read: bool = True) -> TrendLine | None:
        """The trend line of `step`, reading its verdict now if it is still pending (late=True; `read`:
        call this where the training syncs with the device anyway, as at a log step); None for a step
        not checked (every=, a step captured in full, the guard off) or not read, never another step's."""
        if read and self.active and self._pending is not None and self._pending[0] == step:
            self._read_pending()
        return self.last if self.last is not None and self.last.step == step else None

    def live_step(self, step: int, rows: Any) -> LiveStep:
        ranks: dict[int, RankSummary] = {
            rank: self.layout.unpack(
                rows[rank], rank=rank, held=self._held[rank], topology=self._topologies[rank]
            )
            for rank in range(self.world_size)
        }
        return LiveStep(
            step=step,
            world_size=self.world_size,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            groups=self.groups,
            ranks=ranks,
            run_id=self.run_id,
            directory=str(self.out_dir / f"step_{step}"),
        )

    def _judge(self, step: int, found: tuple[LiveStep, Report]) -> None:
        from ..report.model import Severity

        live, report = found
        errors = [f for f in report.findings if f.severity is Severity.ERROR]
        codes = tuple(dict.fromkeys(f.code for f in errors))
        line = trend_line(report, codes)
        self._record_line(line)
        if not errors:
            return
        self.anomalies.append((step, codes))
        dumped = self._safely(lambda: self._dump(live, step, codes))
        messages = [f"gradaudit guard: step {step}: {f.code} {f.message}{_numbers(line)}" for f in errors]
        where = f"; its dump: gradaudit check {live.directory}" if dumped else ""
        if self.on_anomaly == "raise":
            self._pending = None
            raise GuardAnomaly("; ".join(messages) + where, step=step, codes=codes)
        for message in messages:
            self._warn(message + where)

    def _record_line(self, line: TrendLine) -> None:
        self.last = line
        if self.rank == 0:
            self._safely(lambda: self._append_trend(line))
        if self.on_verdict is not None:
            self._safely(lambda: self.on_verdict(line) if self.on_verdict is not None else None)

    def _append_trend(self, line: TrendLine) -> None:
        if self._trend_file is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._trend_file = open(self.out_dir / TREND_FILE, "a", encoding="utf-8")  # noqa: SIM115
        self._trend_file.write(json.dumps(line.to_json(), sort_keys=True) + "\n")
        self._trend_file.flush()

    def _dump(self, live: LiveStep, step: int, codes: tuple[str, ...]) -> bool:
        """Write this rank's file of the step, and arm a full capture of the next; False when the
        dump budget or the cooldown says no."""
        from ..dumpfile.writer import write_rank_file

        if len(self.dumps) >= self.max_dumps:
            return False
        if self._last_dump_step is not None and step - self._last_dump_step < self.cooldown:
            return False
        self._last_dump_step = step
        dump = dataclasses.replace(
            rank_dumps(live)[self.rank],
            host=socket.gethostname(),
            torch_version=_torch_version(),
            gradaudit_version=__version__,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            trigger=TRIGGER,
        )
        self.dumps.append(write_rank_file(live.directory, dump, {}))
        if self.capture_next:
            self._capture_step = self.step + 1  # late or not, the verdict is read before this step ends
        return True

    def _begin_capture(self) -> None:
        from ..capture.session import AuditStep

        step, self._capture_step = self._capture_step, None
        if step is None or step != self.step:
            return
        self._capture = AuditStep(
            self.model if self._ownership is None else _no_parameters(),
            self.out_dir / "full",
            ownership=self._ownership,
            step=step,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            groups=self._groups or None,
            aliases=self._aliases or None,
            run_id=self.run_id,
            scaler=self.scaler,
            capture_api="guard.full",
        ).begin()

    # -- failures ----------------------------------------------------------------------------------

    def _safely(self, action: Callable[[], Any]) -> Any:
        """Run a step of the guard's own work; a failure warns once and switches the guard off."""
        try:
            return action()
        except GuardAnomaly:
            raise
        except Exception as exc:  # noqa: BLE001  the guard must never break training
            self._fail(exc)
            return None

    def _fail(self, exc: Exception) -> None:
        if not self.active:
            return
        self._warn(
            f"gradaudit guard: rank {self.rank} failed at step {self.step} and switches off; training goes on "
            f"without it ({type(exc).__name__}: {exc})"
        )
        self._switch_off()

    def _warn(self, message: str) -> None:
        import warnings

        warnings.warn(message, GuardWarning, stacklevel=2)


def _ownership_keys(
    every_rank: list[list[tuple[str, Any, str, str]]],
) -> tuple[list[list[str]], dict[str, tuple[tuple[int, ...], ...]]]:
    """Per rank, the ownership group of each of its pieces (param, regions, group key, dtype), and the
    groups to add to the topology. A piece that no replica group names but that other ranks hold alike
    (a plain parameter whole on every rank when groups= names no data-parallel group) is a replica over
    its holders, as `gradaudit check` counts it, not a shard of its own on each rank."""
    holders: dict[tuple[str, Any], list[int]] = {}
    for rank, pieces in enumerate(every_rank):
        for param, regions, key, _ in pieces:
            if key == SHARDED and regions is not None:  # an empty piece is no one's copy
                holders.setdefault((param, regions), []).append(rank)
    added: dict[str, tuple[tuple[int, ...], ...]] = {}
    keys_of = []
    for pieces in every_rank:
        keys = []
        for param, regions, key, _ in pieces:
            ranks = holders.get((param, regions), []) if key == SHARDED and regions is not None else []
            if len(ranks) > 1:
                key = f"ranks {','.join(map(str, ranks))}"
                added[key] = (tuple(ranks),)
            keys.append(key)
        keys_of.append(keys)
    return keys_of, added


def _unscaled(terms: Any, sample: Any, scale: float, norm_type: float, num_groups: int) -> tuple[Any, Any]:
    """Group terms (p-th powers of norms, then nonfinite counts) and a sample measured on gradients
    multiplied by the loss scale, as they are once it is divided out."""
    import torch

    if terms is not None:
        power = scale if math.isinf(norm_type) else scale**norm_type
        terms = torch.cat((terms[:num_groups] / power, terms[num_groups:]))
    return terms, None if sample is None else sample / scale


def _loosest_dtype(grads: Iterable[Any]) -> str | None:
    """The dtype of the gradients whose norms the analysis must compare most loosely (None: none yet)."""
    from ..norms import NORM_RTOL_BY_DTYPE

    names = {str(g.dtype).removeprefix("torch.") for g in grads if g is not None}
    return max(sorted(names), key=lambda n: NORM_RTOL_BY_DTYPE.get(n, 0.0), default=None)


def _end_capture(capture: AuditStep) -> None:
    capture.after_optimizer_step()
    capture.end()


def _numbers(line: TrendLine) -> str:
    parts = []
    if line.true_norm is not None:
        parts.append(f"true norm {line.true_norm:.6g}")
    if line.reported_norm is not None:
        parts.append(f"reported {line.reported_norm:.6g}")
    if line.expected_coef is not None:
        parts.append(f"expected coefficient {line.expected_coef:.6g}")
    if line.min_coef is not None and line.max_coef is not None:
        parts.append(f"applied{by_last_call(line)} {line.min_coef:.6g}..{line.max_coef:.6g}")
    return f" ({', '.join(parts)})" if parts else ""


def _device_of(model: Any) -> Any:
    import torch

    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        return local.device
    return torch.device("cpu")


def _no_parameters() -> torch.nn.Module:
    import torch

    return torch.nn.Module()


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


class GuardCallbackOptions:
    """What a framework's GuardCallback holds until training starts: out_dir, max_norm (None: the
    framework's own) and the guard's other keywords; `attach` makes the Guard, `.guard` holds it."""

    def __init__(
        self, out_dir: str | os.PathLike[str], *, max_norm: float | None = None, **guard_kwargs: Any
    ) -> None:
        self.out_dir, self.max_norm, self.guard_kwargs = out_dir, max_norm, guard_kwargs
        self.guard: Guard | None = None

    def attach(self, model: Any, optimizer: Any, setting: str, framework_max_norm: Any, **kw: Any) -> Guard:
        """The Guard clipping to max_norm, else to the framework's (`setting` names where it is set);
        `kw` (first_step, scaler) gives way to the guard keywords the user passed."""
        max_norm = self.max_norm if self.max_norm is not None else framework_max_norm
        if not max_norm:
            raise CaptureError(
                f"GuardCallback needs the max_norm clipping should use: set {setting} "
                "or pass GuardCallback(..., max_norm=...)"
            )
        self.guard = Guard(
            model,
            max_norm=float(max_norm),
            optimizer=optimizer,
            out_dir=self.out_dir,
            **{**kw, **self.guard_kwargs},
        )
        return self.guard


guard = Guard
"""`gradaudit.guard(model, max_norm=..., optimizer=..., out_dir=...)`: the Guard, attached (see `Guard`)."""
