"""`gradaudit.guard`: check every step's clipping while training runs, with one all-gather per checked
step, and dump the step that goes wrong."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import math
import os
import socket
import sys
import traceback
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..capture.arguments import CallRecord, clips_nothing, norm_results
from ..errors import CaptureError, GradauditError
from ..model import Topology
from ..version import __version__
from . import wire
from .agreement import Agreement, agree
from .analysis_input import SHARDED, LiveStep, rank_dump, report_of
from .channel import WAIT_S, Channel, Exchange
from .fastpath import FastVerdict, Reduction, role_of
from .lending import lent
from .replicas import ReplicaFault, replica_faults
from .spike import SpikeTest, spike_watch
from .spike_dump import SpikeSums, params_rank_dump, spike_params, spike_rank_dump
from .summary import (
    FAILED,
    HEADER,
    NONFINITE_SLOTS,
    OFF,
    OK,
    SKIP,
    STEP,
    LocalSummary,
    VectorLayout,
    coefficient,
    group_key,
    ownership_groups,
    pack,
    stamped,
    status_vector,
)
from .trend import TREND_FILE, TrendLine, by_last_call, skipped_line, trend_line
from .watch import ModelWatch
from .writing import FULL_CAPTURES, TrendAppender, attempt_folder, earlier_attempts

if TYPE_CHECKING:
    from types import TracebackType

    from torch.utils.hooks import RemovableHandle

    from ..capture.ownership import LocalPiece
    from ..capture.session import AuditStep
    from ..dumpfile.dump import RankDump
    from ..report.model import Report

OnAnomaly = Literal["warn", "raise"]
ON_ANOMALY = ("warn", "raise")
TRIGGER = "guard"
"""The dump metadata's `trigger` for a step the guard wrote on an anomaly."""
MAX_FAILED_STEPS = 3
"""Checked steps in a row that some rank could not measure before every rank's guard stops."""
WEIGHTS_EVERY = 10
"""Every how many checked steps the replicas' weights are compared after the optimizer step."""
MAX_REALIGNMENTS = 3
"""Times ranks that skipped an optimizer step may catch up before the guard stops."""


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
    device, and one all-gather of a small float64 vector, on a process group of the guard's own, gives
    every rank the same verdict, reached by the analysis `gradaudit check` runs. A step whose clipping
    is wrong is named in a warning (or a GuardAnomaly on every rank with on_anomaly="raise"), written
    as a dump `gradaudit check` reads, and the next step is captured in full under out_dir/full/.
    Rank 0 appends one line per checked step to out_dir/guard_trend.jsonl.

    The guard never stops or changes the training: a failure of its own, a file it cannot write, a
    callback that raises, each costs a warning and the guard goes on; whatever one rank does (skips an
    optimizer step, removes its guard, fails) the others never wait longer than `wait_s` for it, and
    when the ranks cannot go on checking together every rank's guard switches off at the same step.

    Keyword arguments: max_norm, optimizer, out_dir (all three required), norm_type, groups, aliases:
      as `audit_step` takes them; scaler: the torch.amp.GradScaler of fp16 training (the loss scale and
      whether unscale_ ran before the clip are accounted for, and a step the scaler skips for inf
      gradients is written to the trend as skipped, not as an anomaly); every: check every N-th step;
      on_anomaly ("warn" or "raise"); max_dumps (3) and cooldown (100 steps): at most that many dumps, that many
      steps apart; late (on GPU by default): read each verdict at the next step, so that the check adds
      no host sync; first_step (1): the number of the first optimizer step; capture_next (True);
      on_verdict: called on every rank with each checked step's TrendLine (to log the true norm);
      ownership: this rank's pieces, when they are not the model's parameters (DeepSpeed ZeRO);
      wait_s (10): how long a rank waits for the others' numbers of a step before reading them a step
      later (a rank that never sends them switches the guard off after twice that); spike: a factor
      over the median true norm of the last 20 checked steps, or a callable (step, true_norm,
      recent_norms) -> bool: a step it calls a spike is marked in the trend, the parameters holding
      most of its Σg² are named, and each rank writes their statistics as a dump (max_dumps of them);
      weights_every (10): every N-th checked step, and every step whose rows are gathered (every step
      it dumps), the replicas' weights after the optimizer step are compared too (GA605: a replica
      whose weights drifted from the others').
    `guard.remove()` stops it; `with gradaudit.guard(...):` removes it on exit.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_norm: float | Callable[[int], float],
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
        wait_s: float = WAIT_S,
        spike: float | SpikeTest | None = None,
        weights_every: int = WEIGHTS_EVERY,
    ) -> None:
        from ..capture.arguments import check_max_norm, check_norm_type, check_run_id, rank_and_world_size
        from ..capture.optimizers import hookable_optimizer
        from ..capture.scaler import ScalerWatch
        from ..capture.topology import normalize_groups

        self._spike = spike_watch(spike)
        self._spike_dumps = 0
        self._schedule = max_norm if callable(max_norm) else None
        self.max_norm = check_max_norm(max_norm(first_step) if callable(max_norm) else max_norm)
        """The max_norm the step under way is checked against (a schedule's value at that step)."""
        self.norm_type = check_norm_type(norm_type)
        if on_anomaly not in ON_ANOMALY:
            raise CaptureError(f"on_anomaly must be 'warn' or 'raise', got {on_anomaly!r}")
        for name, value, least in (
            ("every", every, 1),
            ("weights_every", weights_every, 1),
            ("max_dumps", max_dumps, 0),
            ("cooldown", cooldown, 0),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise CaptureError(f"{name} must be an integer of at least {least}, got {value!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not wait_s > 0:
            raise CaptureError(f"wait_s must be a number of seconds above 0, got {wait_s!r}")
        self.optimizer = hookable_optimizer(optimizer)
        if self.optimizer is None:
            raise CaptureError(
                "gradaudit.guard needs optimizer= (the optimizer whose step ends each training step)"
            )
        self.model = model
        self.out_dir = Path(out_dir)
        self.every = every
        self.weights_every = weights_every
        self._weight_faults: tuple[ReplicaFault, ...] = ()
        """Of the step being judged: the replicas whose weights differ from the others' after its step."""
        self._weights_agreed_at: int | None = None
        """The last step whose replicas' weights were compared and agreed."""
        self._weights_after: int | None = None
        """The step whose optimizer step made the weights as they are now (see `_with_weights`)."""
        self.on_anomaly = on_anomaly
        self.max_dumps = max_dumps
        self.cooldown = cooldown
        self.scaler = scaler
        self._scaler = ScalerWatch(scaler, self.optimizer) if scaler is not None else None
        self._scale_at_clip: tuple[Any, bool | None] | None = None
        """(loss scale, whether unscale_ had run) at the latest clip call of the step; and at its first.
        The scale is a tensor on the scaler's device, never read on the host (see ScalerWatch.scale_unread):"""
        self._scale_at_first_clip: tuple[Any, bool | None] | None = None
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
        self.skipped_steps: list[tuple[int, tuple[int, ...]]] = []
        """(step, ranks) of every optimizer step some ranks skipped while the others took it."""
        self.dumps: list[Path] = []
        self.active = False
        self._late = late
        self._wait_s = float(wait_s)
        self._hooks: list[RemovableHandle] = []
        self._interception: Any = None
        self._calls: list[CallRecord] = []
        self._num_calls = 0
        self._unmeasured = False
        """A clip call of this step could not be measured: the step is sent as FAILED."""
        self._sites: list[str] = []
        """file:line of each clip call of the step under way, in the training code."""
        self._first_norms: Any = None
        """The per-piece norms of the step's gradients before its first clip call (see LocalSummary)."""
        self._nonfinite_in: list[str] = []
        """Of the step being judged: the parameters (and ranks) nonfinite before its first clip call."""
        self._faults: tuple[ReplicaFault, ...] = ()
        """Of the step being judged: the copies of replicated groups that differ from their replicas'."""
        self._faulty: dict[int, list[int]] = {}
        """Rank -> the steps its copy differed from its replicas' (see _fault_text)."""
        self._said_of: dict[int, tuple[tuple[str, ...], Any]] = {}
        """Per step sent and not judged yet: its clip calls' sites and its per-piece norms before the
        first clip call (on the device)."""
        self._channel: Channel | None = None
        self._exchange: Exchange | None = None
        """The step whose numbers were sent to the other ranks and are not read yet."""
        self._staged: tuple[int, Any, Any] | None = None
        """(step, vector, event) of a vector on the device, sent once its copy to the host is done."""
        self._watch: ModelWatch | None = None
        self._failed_in_a_row = 0
        self._realignments = 0
        self._num_dumped = 0
        self._last_dump_step: int | None = None
        self._capture: AuditStep | None = None
        self._capture_step: int | None = None
        self._trend = TrendAppender(self.out_dir / TREND_FILE)
        self._dump_dir = self.out_dir
        self._paused = False
        self._warned: set[str] = set()
        self._repeat: tuple[tuple[str, ...], list[int]] | None = None
        """(codes, the later steps it was found at) of the anomaly warned last, while it repeats."""
        self._num_judged = 0
        first = _attached_guard(model, self.optimizer)
        if first is not None:
            self._warn(
                f"gradaudit guard: a guard is already attached to this model or optimizer (out_dir "
                f"{os.fspath(first.out_dir)!r}); this one checks nothing. Attach one guard only: a "
                "framework's GuardCallback already is one"
            )
            return
        try:
            self._channel = Channel.open(self.world_size, self._wait_s)
            self._infer(attaching=True)
        except GuardAnomaly:
            raise
        except Exception as exc:  # noqa: BLE001  the guard must never break training
            self._warn(f"gradaudit guard: rank {self.rank} could not attach, the guard is off: {_said(exc)}")
            return
        self._device = _device_of(self.model)
        if self._late is None:
            self._late = self._device.type != "cpu"
        self._install()
        _ATTACHED[id(self.optimizer)] = self
        self.active = True
        atexit.register(_summary_at_exit, weakref.ref(self))

    # -- attaching and removing -----------------------------------------------------------------

    def _infer(self, *, attaching: bool = False) -> None:
        """Infer this rank's ownership and exchange it with the other ranks (every rank at once: when
        attaching, and when the agreed numbers of a step say some rank's parameters changed)."""
        from ..capture.infer import infer_ownership
        from ..warn import warn_once

        def unsupported(param: str, exc: Exception) -> None:
            warn_once(
                f"guard:{param}", f"gradaudit guard: parameter {param!r} is left out of every check: {exc}"
            )

        assert self._channel is not None
        try:
            ownership = infer_ownership(
                self.model if self._ownership is None else _no_parameters(),  # given pieces: nothing to infer
                explicit=self._ownership or (),
                rank=self.rank,
                world_size=self.world_size,
                groups=self._groups,
                aliases=self._aliases,
                on_unsupported=unsupported,
            )
            local = tuple(ownership.pieces)  # each row read once: a large model has many
            pieces = [
                (p.param, p.regions if math.prod(p.local_shape) else None, group_key(p), p.dtype)
                for p in local
            ]
            attempts = earlier_attempts(self.out_dir) if attaching else 0
            place = {"host": socket.gethostname(), "device": str(_device_of(self.model))}
            mine = b"+" + wire.encode(pieces, ownership.topology, attempts, **place)
        except Exception as exc:  # noqa: BLE001  every rank must still take part in the exchange
            mine = f"-rank {self.rank}: {_said(exc)}".encode()
        wait_s = max(self._wait_s, 300.0) if attaching else self._wait_s  # ranks start unevenly
        sent = self._channel.exchange_bytes(mine, wait_s)
        failed = [data[1:].decode(errors="replace") for data in sent if not data.startswith(b"+")]
        if failed:
            raise CaptureError(f"ownership could not be inferred: {'; '.join(failed)}")
        every_rank = [wire.decode(data[1:]) for data in sent]
        keys_of, added = _ownership_keys([told.pieces for told in every_rank])
        keys = keys_of[self.rank]
        dtype_of: dict[str, str] = {}
        for told, rank_keys in zip(every_rank, keys_of, strict=True):
            for (*_, dtype), key in zip(told.pieces, rank_keys, strict=True):
                dtype_of.setdefault(key, dtype)
        self.groups = ownership_groups([k for rank_keys in keys_of for k in rank_keys], dtype_of)
        position = {g.name: i for i, g in enumerate(self.groups)}
        self._held = [tuple(g.name in rank_keys for g in self.groups) for rank_keys in keys_of]
        self._topologies: list[Topology] = [
            dataclasses.replace(told.topology, groups={**told.topology.groups, **added})
            if added
            else told.topology
            for told in every_rank
        ]
        self.layout = VectorLayout(num_groups=len(self.groups))
        self._reduction = Reduction(layout=self.layout)
        self._role = role_of(self.rank, self.groups, self._held, self._topologies)
        self._params_of = [[piece[0] for piece in told.pieces] for told in every_rank]
        self._spike_sums = SpikeSums(
            local, spike_params(self._params_of), [self._role.lowest[position[k]] for k in keys]
        )
        self._pieces = local
        self._places = [f"host {told.host}, device {told.device}" for told in every_rank]
        self._calibrated = False  # the first step judged on this ownership is judged in full
        self._summary = LocalSummary(
            local,
            [position[k] for k in keys],
            self.layout,
            self.norm_type,
            model=self.model,
            replicated=[i for i, group in enumerate(self.groups) if group.replica_group is not None],
        )
        self._grad_dtype = None
        if attaching:
            self._dump_dir = attempt_folder(self.out_dir, max(told.attempts for told in every_rank))
            self._watch = ModelWatch(
                self.model, self.optimizer, follow=self._ownership is None, on_forward=self._new_forward
            )
        else:
            assert self._watch is not None
            self._watch.mark()

    def pause(self) -> None:
        """Check no step until `resume()`: the steps in between are neither measured nor judged, and
        still counted, so the guard's step numbers stay the optimizer's. Pause and resume every rank at
        the same step: a rank paused alone makes the others' steps unchecked, never a wrong verdict."""
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

    def remove(self) -> None:
        """Stop checking (after reading a verdict still pending); the model and optimizer are left as
        they were. The other ranks' guards stop at the same step as this one (remove every rank's)."""
        try:
            if self.active:
                self._read(settle=True)
                self._say_summary()
        finally:
            if self.active and self._channel is not None and self._channel.groups is not None:
                # the others' next exchange pairs with this one and tells them this guard left; it is
                # waited for (wait_s at most), so that no exchange of the guard is left in flight
                self._safely("leave", lambda: self._send(status_vector(self.layout, OFF)))
                self._safely("leave", self._settle_last)
            self._switch_off()
            self._trend.close()

    def _settle_last(self) -> None:
        exchange, channel = self._exchange, self._channel
        if exchange is not None and channel is not None:
            channel.read(exchange, self._wait_s)

    def _switch_off(self) -> None:
        self.active = False
        self._exchange = self._staged = None
        self._uninstall()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._watch is not None:
            self._watch.remove()
        if _ATTACHED.get(id(self.optimizer)) is self:
            del _ATTACHED[id(self.optimizer)]
        if self._capture is not None:
            self._capture.cancel()
            self._capture = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.drop_pending()  # the training failed: its exception matters, not the last verdict
        self.remove()

    def drop_pending(self) -> None:
        """Forget the verdict not read yet (the training failed: its exception matters, not that verdict)."""
        self._exchange = self._staged = None

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

        lends = call.target.kind == "norm" and call.target.module in _TORCH_CLIP_MODULES
        self._measured(make, call.args, call.kwargs, fn_for_arguments=call.fn, lends=lends)
        return made[0]

    def _measured(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        fn_for_arguments: Callable[..., Any] | None = None,
        lends: bool = False,
    ) -> Any:
        """Call fn; on a checked step, record the gradient's group norms and sample around the call.
        `fn` returns the norm the call clipped with; with `lends` it is torch's clip_grad_norm_, which
        takes the per-gradient norms the guard took just before it (see lending.py)."""
        if not self._checked or clips_nothing(fn_for_arguments or fn, args, kwargs):
            return fn(*args, **kwargs)  # max_norm=inf reads the norm: a measurement, not a clip call
        before = self._safely("measure", self._before_call)
        done, self._summary.lendable = self._summary.lendable, None
        with lent(done if lends and before is not None else None):
            result = fn(*args, **kwargs)
        recorded = before is not None and self._safely(
            "measure", lambda: self._record_call(before, fn_for_arguments or fn, args, kwargs, result)
        )
        self._unmeasured = self._unmeasured or not recorded  # the step is sent as not measured
        return result

    def clip(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a clipping function the guard does not see by itself (your own, returning the norm it
        clipped with) and return what it returns; the guard records it as a clip call of the step."""
        from ..capture import intercept

        if self._capture is not None:  # a step captured in full: the capture records the call
            return self._capture.clip(fn, *args, **kwargs)
        if intercept.inside():
            return fn(*args, **kwargs)
        return intercept.recorded(
            self._interception, fn, args, kwargs, lambda: self._measured(fn, args, kwargs)
        )

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
            self._calls[-1] = dataclasses.replace(self._calls[-1], coef=coef)

    def _before_call(self) -> tuple[Any, Any, Any, bool | None]:
        terms, sample, sampled = self._summary.measure()
        if not self._calls:  # the gradients before any clip of the step: where a nonfinite value began
            self._first_norms = self._summary.last_norms
        unscaled = self._scaler.unscaled() if self._scaler is not None else None
        return terms, sample, sampled, unscaled

    def _record_call(
        self,
        before: tuple[Any, Any, Any, bool | None],
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        result: Any,
    ) -> bool:

        terms, sample, sampled, unscaled_before = before
        if self._scaler is not None:
            self._scale_at_clip = (self._scaler.scale_unread(), self._scaler.unscaled())
            self._scale_at_first_clip = self._scale_at_first_clip or self._scale_at_clip
            scale, unscaled = self._scale_at_clip
            if unscaled_before is False and unscaled and _scales(scale):
                # the call unscaled the gradients before its norm (accelerator.clip_grad_norm_ does):
                # what was measured before it is divided by the loss scale, as the call saw it
                terms, sample = _unscaled(terms, sample, scale, self.norm_type, self.layout.num_groups)
        elif self._call_unscales != 1.0:
            terms, sample = _unscaled(
                terms, sample, self._call_unscales, self.norm_type, self.layout.num_groups
            )
        record = CallRecord.of(
            fn, args, kwargs, norm_results(result), terms=terms, before=sample, sampled=sampled
        )
        self._sites.append(user_site())
        self._num_calls += 1
        if len(self._calls) < self.layout.max_calls:
            self._calls.append(record)
        else:
            self._calls[-1] = record
        return True

    def _new_forward(self) -> None:
        """A training forward pass begins: clip calls recorded since the last optimizer step whose
        gradients are gone (zero_grad) belonged to a step the training discarded, not to this one."""
        if self._calls and not self._summary.has_gradients():
            self._calls, self._num_calls = [], 0
            self._sites, self._first_norms = [], None
            self._scale_at_clip = self._scale_at_first_clip = None

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active:
            self._read()  # late: the last step's verdict; a GuardAnomaly raised here stops every rank before this step
        if self._capture is not None:
            capture = self._capture
            self._safely("capture", capture.before_optimizer_step)

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
            # no clip call seen: the optimizer steps with these; what any clip applied is unknown
            terms, applied = self._summary.terms(), math.nan
            self._first_norms = self._summary.last_norms
        scaler: tuple[Any, bool | None, bool | None] = (None, None, skipped)
        if self._scaler is not None:
            scale, unscaled = self._scale_at_first_clip or (self._scaler.scale_unread(), None)
            scaler = (scale, unscaled, skipped)
            at_last: tuple[Any, bool | None] = self._scale_at_clip or (None, None)
            last_scale, last_unscaled = at_last
            if last_unscaled is False and _scales(last_scale) and not skipped:
                # scaler.step unscaled the gradients after the clip: the sample at the step shows the
                # clip's coefficient divided by the loss scale
                applied = applied * last_scale
        if self._grad_dtype is None:  # once: read from the gradients' metadata, no pass over them
            self._grad_dtype = _loosest_dtype(p.grad() for p in self._summary.pieces)
        weights = self._summary.weight_terms() if self._weight_check(self.step) else None
        vector = pack(
            self.layout,
            device=self._device,
            terms=terms,
            applied_coef=applied,
            calls=self._calls,
            num_calls=self._num_calls,
            scaler=scaler,
            grad_dtype=self._grad_dtype,
        )
        g, first = self.layout.num_groups, self._first_norms
        if weights is not None:
            vector[self.layout.weights_offset : self.layout.weights_offset + g].copy_(weights)
        on_host = vector.device.type == "cpu"
        # on the host the counts are read at no cost; on a device the pieces are found without a read
        if first is not None and (not on_host or vector.numpy()[HEADER + g : HEADER + 3 * g].any()):
            at = self.layout.nonfinite_offset
            vector[at : at + NONFINITE_SLOTS].copy_(self._summary.nonfinite_pieces(first))
        return vector

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # The summary is sent after the step, not before: a closure (Lightning, LBFGS) runs the backward
        # and the clip inside optimizer.step(); optimizers leave the gradients as they were.
        self._stepped = True
        self._weights_after = self.step
        self._end_of_step(skipped=False)

    def _end_of_step(self, *, skipped: bool) -> None:
        try:
            if self.active and self.step % self.every == 0:
                self._take_part(skipped)
        finally:
            self._end_step()

    def _take_part(self, skipped: bool) -> None:
        """Send this step's numbers to the other ranks: measured, or a status when they are not. Every
        rank sends one vector per step it would check, whatever happened to it, so that the ranks'
        exchanges stay paired step for step."""
        self._read(settle=True)  # the last step's numbers are read before this step's are sent
        if not self.active or self.step % self.every != 0:  # switched off, or caught up a skipped step
            return
        vector, status = None, FAILED
        if not self._checked:
            status = SKIP  # paused, or captured in full: the capture's own route sees its clip calls
        elif not self._unmeasured:
            vector = self._safely("measure", lambda: self._vector(skipped=skipped))
        if vector is None:
            vector = status_vector(self.layout, status, self._device)
        self._said_of[self.step] = (tuple(self._sites), self._first_norms)
        for old_step in [k for k in self._said_of if k < self.step - 2 * self.every]:
            del self._said_of[old_step]
        watch = self._watch
        assert watch is not None
        changed = self._safely("measure", watch.changed)
        self._send(stamped(vector, step=self.step, clock=watch.forwards, changed=bool(changed)))
        if not self._late:
            self._read()

    def _send(self, vector: Any) -> None:
        """Post `vector` to the other ranks (a device vector once its copy to the host is done); a rank
        that cannot post stops its guard (the others stop theirs when its numbers do not come)."""
        try:
            if vector.device.type == "cpu":
                self._post(self.step, vector)
                return
            host = vector.to("cpu", non_blocking=True)
            event = None
            if vector.device.type == "cuda":
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record()
            self._staged = (self.step, host, event)
            if not self._late:
                self._post_staged()
        except Exception as exc:
            if _is_signal(exc):
                raise
            self._stop(f"it could not send its numbers of step {self.step} ({_said(exc)})", alone=True)

    def _post_staged(self) -> None:
        if self._staged is None:
            return
        step, host, event = self._staged
        self._staged = None
        try:
            if event is not None and not event.query():  # a step late, the copy is long done
                event.synchronize()
            self._post(step, host)
        except Exception as exc:
            if _is_signal(exc):
                raise
            self._stop(f"it could not send its numbers of step {step} ({_said(exc)})", alone=True)

    def _post(self, step: int, row: Any) -> None:
        """Post this rank's part of the step's one sum (see fastpath); its row goes with it."""
        assert self._channel is not None
        part = self._reduction.contribution(row.numpy(), self._role, self._declared(step))
        self._exchange = self._channel.post_sum(step, torch.from_numpy(part), row)

    def _end_step(self) -> None:
        capture = self._capture
        if capture is not None:
            self._capture = None
            self._safely("write the full capture of", lambda: _end_capture(capture))
        self._calls, self._num_calls = [], 0
        self._sites, self._first_norms = [], None
        self._unmeasured = False
        self._scale_at_clip = self._scale_at_first_clip = None
        self.step += 1
        if self._capture_step is not None and self.active and not self._paused:
            self._safely("begin the full capture of", self._begin_capture)

    # -- the verdict -----------------------------------------------------------------------------

    def _read(self, *, settle: bool = False) -> None:
        """Read the numbers sent last once the other ranks' have come, waiting at most wait_s for them
        (else they are read later). With `settle`, or when a wait already ran out for them once, the
        others are taken to be gone: this rank's guard switches off rather than wait any longer."""
        while self.active:
            self._post_staged()
            exchange = self._exchange
            if exchange is None:
                return
            assert self._channel is not None
            late_already = exchange.waited
            try:
                gathered = self._channel.read(exchange)
            except Exception as exc:
                if _is_signal(exc):
                    raise
                self._exchange = None
                self._stop(
                    f"its exchange of step {exchange.step} with the other ranks failed ({exc})", alone=True
                )
                return
            if gathered is None:
                if settle or late_already:
                    self._exchange = None
                    self._stop(
                        f"rank(s) did not send their numbers of step {exchange.step} within "
                        f"{2 * self._wait_s:g} s (a rank that skipped an optimizer step, or paused, removed or "
                        "switched off its guard alone)",
                        alone=True,
                    )
                return
            self._exchange = None
            if exchange.row is None:
                rows = gathered.numpy().reshape(self.world_size, -1)
                self._safely("judge", functools.partial(self._conclude, exchange, rows))
                continue
            fast = self._safely("judge", functools.partial(self._fast_verdict, exchange.step, gathered))
            if fast is not None:
                self._safely("judge", functools.partial(self._conclude_fast, exchange.step, fast))
                continue
            try:  # the sum does not settle the step: every rank's row, read in the same loop
                self._exchange = self._channel.post(
                    exchange.step, self._with_weights(exchange.step, exchange.row)
                )
            except Exception as exc:
                if _is_signal(exc):
                    raise
                self._stop(
                    f"it could not send its numbers of step {exchange.step} ({_said(exc)})", alone=True
                )

    def _fast_verdict(self, step: int, summed: Any) -> FastVerdict | None:
        fast = self._reduction.verdict(
            summed.numpy(), norm_type=self.norm_type, max_norm=self._declared(step)
        )
        if fast is not None and fast.kind == "passed" and not self._calibrated:
            return None  # the first step of an ownership is judged in full
        return fast

    def _conclude_fast(self, step: int, fast: FastVerdict) -> None:
        """A step the sum settles: every rank agrees, or none measured it (paused alike)."""
        if fast.kind == "off":
            ranks = f"rank(s) {list(fast.left)}" if fast.left else "ranks"
            self._stop(f"{ranks} removed or switched off their guard at step {step}")
            return
        self._failed_in_a_row = self._realignments = 0
        if fast.kind == "not_measured":
            return
        if math.isfinite(fast.passed_max_norm):
            self._told_other_max_norm(step, fast.passed_max_norm, self.max_norm)
        if self._weight_check(step):
            self._weights_agreed_at = step
        if fast.kind == "skipped":
            self._record_line(skipped_line(step, fast.reported_norm))
            return
        self._num_judged += 1
        line = TrendLine(
            step=step,
            true_norm=fast.true_norm,
            reported_norm=fast.reported_norm,
            expected_coef=fast.expected_coef,
            min_coef=fast.min_coef,
            max_coef=fast.max_coef,
        )
        self._record_line(self._with_spike(step, line))
        self._end_repeat()

    def _conclude(self, exchange: Exchange, rows: Any) -> None:
        agreement = agree(rows)
        step = exchange.step
        conclusion = agreement.conclusion
        if conclusion != "failed":
            self._failed_in_a_row = 0
        if conclusion == "judge":
            self._realignments = 0
            self._ask_where_nonfinite(rows)
            self._faults = replica_faults(rows, self.groups, self._held, self._topologies)
            held = self._weights_held(rows, step)
            self._weight_faults = (
                ()
                if held is None
                else replica_faults(rows, self.groups, held, self._topologies, at=self.layout.weights_offset)
            )
            if held is not None and not self._weight_faults:
                self._weights_agreed_at = step
            live = self._safely("judge", lambda: self._as_clipped(self.live_step(step, rows)))
            if live is not None and all(r.skipped for r in live.ranks.values()):
                # the optimizer did not step: nothing was clipped; the norm the first clip call returned
                reported = next((c.reported_norm for r in live.ranks.values() for c in r.calls), None)
                self._record_line(skipped_line(step, reported))
            elif live is not None:
                report = self._safely("judge", lambda: report_of(live))
                if report is not None:
                    self._judge(step, (live, report))
        elif conclusion == "off":
            self._stop(f"rank(s) {list(agreement.ranks)} removed or switched off their guard at step {step}")
        elif conclusion == "out_of_step":
            self._stop(f"the ranks' guards are out of step ({agreement.detail})")
        elif conclusion == "skipped_step":
            self._caught_up(exchange, agreement)
        elif conclusion == "failed":
            self._failed_in_a_row += 1
            ranks = list(agreement.ranks)
            if self._failed_in_a_row >= MAX_FAILED_STEPS:
                self._stop(f"rank(s) {ranks} could not measure {MAX_FAILED_STEPS} steps in a row")
            else:
                self._warn_once(
                    "failed",
                    f"gradaudit guard: step {step} is not checked: rank(s) {ranks} could not measure it",
                    shared=True,
                )
        elif conclusion == "changed":
            try:
                self._infer()
            except Exception as exc:  # noqa: BLE001  the guard must never break training
                self._stop(
                    f"ownership could not be inferred again after the parameters changed ({_said(exc)})"
                )
                return
            self._warn(
                f"gradaudit guard: step {step} is not checked: the trained parameters changed on rank(s) "
                f"{list(agreement.ranks)}; ownership is inferred again and checked from the next step",
                shared=True,
            )

    def _declared(self, step: int) -> float:
        """The max_norm declared for `step`: the schedule's value, or the one number given."""
        if self._schedule is None:
            return self.max_norm
        from ..capture.arguments import check_max_norm

        self.max_norm = check_max_norm(self._schedule(step))
        return self.max_norm

    def _as_clipped(self, live: LiveStep) -> LiveStep | None:
        """`live` checked against the max_norm its clip calls passed when every rank's last call
        passed one other than the declared (named once); None when they passed another norm_type,
        which the guard's measured norms cannot be compared with."""
        last = [r.calls[-1] for r in live.ranks.values() if r.calls]
        passed = {c.max_norm for c in last if c.max_norm is not None}
        types = {c.norm_type for c in last if c.norm_type is not None}
        if types and types != {live.norm_type}:
            self._warn_once(
                "norm_type",
                f"gradaudit guard: the clip calls pass norm_type {', '.join(f'{t:g}' for t in sorted(types))}, "
                f"the guard was told {live.norm_type:g}: no step is checked until they agree (pass the "
                "norm_type your loop clips with)",
                shared=True,
            )
            return None
        if len(passed) != 1 or len(last) != len(live.ranks):
            return live
        (used,) = passed
        if not self._told_other_max_norm(live.step, used, live.max_norm):
            return live
        return dataclasses.replace(live, max_norm=used)

    def _told_other_max_norm(self, step: int, used: float, declared: float) -> bool:
        """Whether the clip calls passed a max_norm other than the declared (said once)."""
        if math.isclose(used, declared, rel_tol=1e-6):
            return False
        self._warn_once(
            "max_norm",
            f"gradaudit guard: step {step}: the clip call passes max_norm {used:g}, the guard was told "
            f"{declared:g}: checked against {used:g} (pass the max_norm your loop clips with, or "
            "max_norm=a function of the step for a schedule)",
            shared=True,
        )
        return True

    def _caught_up(self, exchange: Exchange, agreement: Agreement) -> None:
        """Some ranks skipped an optimizer step (`agreement.ranks`, whose forward passes ran ahead):
        named, and those ranks count the step they skipped, so that the ranks' next exchanges pair the
        same training step again; their numbers sent for this one stand for the others' next step."""
        step = exchange.step
        ranks = agreement.ranks
        self.skipped_steps.append((step, ranks))
        self._realignments += 1
        if self._realignments > MAX_REALIGNMENTS:
            self._stop(
                f"rank(s) {list(ranks)} keep skipping optimizer steps the others take ({agreement.detail})"
            )
            return
        self._warn(
            f"gradaudit guard: rank(s) {list(ranks)} skipped optimizer step {step} ({agreement.detail}): "
            f"their parameters were not updated at that step and now differ from the other ranks'; step "
            f"{step} is not checked",
            shared=True,
        )
        if self.rank not in ranks:
            return
        self.step += 1
        if (step + 1) % self.every == 0:
            row = exchange.row if exchange.row is not None else exchange.vector
            row[STEP] = float(step + 1)
            self._post(step + 1, row)  # a failure: see _safely in _read

    def line_of(self, step: int, *, read: bool = True) -> TrendLine | None:
        """The trend line of `step`, reading its verdict now if it is still pending (late=True; `read`:
        call this where the training syncs with the device anyway, as at a log step); None for a step
        not checked (every=, a step captured in full, the guard off) or not read, never another step's."""
        if read and self.active and step in self._unread_steps():
            self._read()
        return self.last if self.last is not None and self.last.step == step else None

    def _unread_steps(self) -> tuple[int, ...]:
        return tuple(x.step for x in (self._exchange,) if x is not None) + tuple(
            s[0] for s in (self._staged,) if s is not None
        )

    def live_step(self, step: int, rows: Any) -> LiveStep:
        ranks = self.layout.unpack_rows(rows[: self.world_size], held=self._held, topologies=self._topologies)
        return LiveStep(
            step=step,
            world_size=self.world_size,
            max_norm=self._declared(step),
            norm_type=self.norm_type,
            groups=self.groups,
            ranks=ranks,
            run_id=self.run_id,
            directory=str(self._dump_dir / f"step_{step}"),
        )

    def _judge(self, step: int, found: tuple[LiveStep, Report]) -> None:
        from ..report.model import Severity

        live, report = found
        errors = [f for f in report.findings if f.severity is Severity.ERROR]
        said_of = [f"{f.code} {f.message}{self._where(f.code, live)}" for f in errors]
        if self._weight_faults:  # live only: the guard's dump holds no weights
            said_of.append(
                "GA605 " + "; ".join(self._drift_text(fault, step) for fault in self._weight_faults)
            )
        codes = tuple(dict.fromkeys([*(f.code for f in errors), *(["GA605"] if self._weight_faults else [])]))
        line = trend_line(report, codes)
        self._num_judged += 1
        # the common path may judge the next steps once a full diagnosis found the ownership sound
        self._calibrated = self._calibrated or not any(code.startswith("GA1") for code in codes)
        line = self._with_spike(step, line)
        self._record_line(line)
        if not codes:
            self._end_repeat()
            return
        self.anomalies.append((step, codes))
        for fault in self._faults if "GA601" in codes else ():
            for rank in fault.ranks if fault.agreeing else ():
                self._faulty.setdefault(rank, []).append(step)
        dumped = self._dump(live, step, codes)
        said = "; ".join(said_of)
        where = (
            f"; its dump: gradaudit check {live.directory}"
            if dumped
            else f"; not dumped (max_dumps, cooldown): gradaudit check {os.fspath(self.out_dir)} lists it"
        )
        message = f"gradaudit guard: step {step}: {said}{_numbers(line)}{where}"
        if self.on_anomaly == "raise":
            raise GuardAnomaly(message, step=step, codes=codes)
        if self._repeat is not None and self._repeat[0] == codes and not dumped:
            self._repeat[1].append(step)  # said once; counted until it stops
            logging.getLogger(__name__).debug(message)
            return
        self._end_repeat()
        self._warn(message, shared=True)
        self._repeat = (codes, [])

    def _with_spike(self, step: int, line: TrendLine) -> TrendLine:
        """`line`, marked when the spike= rule calls its true norm a spike (a step without error codes:
        an anomaly is dumped and named already); every rank decides alike from the same numbers."""
        watch = self._spike
        if watch is None:
            return line
        spiked = not line.codes and watch.is_spike(step, line.true_norm)
        note = watch.note(line.true_norm) if spiked and line.true_norm is not None else ""
        watch.observe(line.true_norm)
        if not spiked:
            return line
        self._say_spike(step, line, note)
        return dataclasses.replace(line, spike=True)

    def _say_spike(self, step: int, line: TrendLine, note: str) -> None:
        """Name the parameters holding most of the spike's Σg² (one exchange of their sums, every rank
        taking part) and write this rank's statistics of them (max_dumps spike dumps at most)."""
        from ..dumpfile.writer import write_rank_file
        from .spike import shares_text, top_shares

        assert self._channel is not None
        norms = self._said_of.get(step, ((), None))[1]
        known = norms is not None and self.norm_type == 2.0
        part = (
            self._spike_sums.of(norms)
            if known
            else torch.zeros(len(self._spike_sums.names), dtype=torch.float64)
        )
        summed = self._channel.read(self._channel.post_sum(step, part, None, kind="spike"), self._wait_s)
        shares = (
            shares_text(top_shares(self._spike_sums.names, summed.tolist())) if summed is not None else ""
        )
        directory = self._dump_dir / f"step_{step}"
        where = ""
        if known and self._spike_dumps < self.max_dumps:
            self._spike_dumps += 1
            dump = spike_rank_dump(
                rank=self.rank,
                world_size=self.world_size,
                step=step,
                pieces=self._pieces,
                norms=norms,
                topology=self._topologies[self.rank],
                clip=(line.reported_norm, self.max_norm, self.norm_type),
                note=f"{note}; {shares}" if shares else note,
                run_id=self.run_id,
            )
            try:
                self.dumps.append(write_rank_file(directory, dump, {}))
                where = f"; its per-parameter statistics: gradaudit check {directory}"
            except (OSError, GradauditError) as exc:
                self._warn_once(
                    f"spike:{type(exc).__name__}", f"gradaudit guard: the spike dump of step {step}: {exc}"
                )
        found = f"; {shares}" if shares else ""
        self._warn(f"gradaudit guard: step {step}: a spike: {note}{found}{where}", shared=True)

    def _where(self, code: str, live: LiveStep) -> str:
        """Where in the training code or the model a finding happened: the clip calls' lines (GA501),
        the parameters whose gradients were nonfinite before any clip (GA401, asked of every rank)."""
        sites = self._said_of.get(live.step, ((), None))[0]
        if code == "GA501" and sites:
            return f" (clip calls at {', '.join(sites)} on rank {self.rank})"
        if code == "GA401" and self._nonfinite_in:
            return f" (nonfinite before any clip in {', '.join(self._nonfinite_in)})"
        if code == "GA601" and self._faults:
            return " — " + "; ".join(self._fault_text(fault, live.step) for fault in self._faults)
        return ""

    def _with_weights(self, step: int, row: Any) -> Any:
        """This rank's `row` of a step the sum did not settle (every step the guard dumps is one), to
        be gathered: on a step that is no weight check, with the weights block filled in (see
        summary.VectorLayout) so that the gathered rows compare the replicas' weights too (GA605)
        at no collective of their own. The weights are those after `step`'s optimizer step, as on a
        weight check's step: they are filled only while no later optimizer step has run (late=True
        reads the verdict before the next step's optimizer step), else the block stays nan and
        `_weights_held` leaves the step's weights uncompared."""
        if self._weight_check(step) or self._weights_after != step or float(row[0]) != OK:
            return row
        weights = self._safely("measure the weights of", self._summary.weight_terms)
        if weights is not None:
            at = self.layout.weights_offset
            row[at : at + self.layout.num_groups] = weights.to("cpu")
        return row

    def _weights_held(self, rows: Any, step: int) -> Sequence[Sequence[bool]] | None:
        """Which ranks' weights of which groups the gathered `rows` of `step` hold: every holder's on a
        weight check's step; on another step the same when every measured rank holding a replica filled
        its block in (`_with_weights`) and the step's own update was the same on every replica
        (`_same_update`), else None: the step's weights are not compared. Nor are they between a step
        some ranks skipped (their weights differ from then on, as `_caught_up` says) and the next
        weight check, which compares them as before."""
        import numpy as np

        if self._weight_check(step):
            return self._held
        checks = step // self.every
        last_check = (checks - checks % self.weights_every) * self.every
        if self.skipped_steps and self.skipped_steps[-1][0] >= last_check:
            return None
        if self._faults or not self._same_update(rows):
            return None
        at = self.layout.weights_offset
        replicated = [i for i, group in enumerate(self.groups) if group.replica_group is not None]
        for rank, row in enumerate(rows):
            mine = [at + i for i in replicated if self._held[rank][i]]
            if row[0] == OK and mine and np.isnan(row[mine]).all():
                return None
        return self._held

    def _same_update(self, rows: Any) -> bool:
        """Whether every measured rank's row says its optimizer step made the same update of the same
        gradient copies: the same clip calls (reported norm, max_norm, norm_type bit for bit), the same
        scaler state, and applied coefficients within the gradients' dtype's tolerance. A step whose
        ranks clipped differently (GA301, a rank's scaler skipping alone) makes its replicas' weights
        differ by itself, which its own findings name: only after a step that did not can a difference
        of the weights say they drifted before it (GA605, a rank-local fault)."""
        import numpy as np

        from ..norms import NORM_RTOL_BY_DTYPE
        from .summary import GRAD_DTYPES

        measured = rows[rows[:, 0] == OK]
        if not len(measured):
            return False
        calls = min(int(measured[0, 1]), self.layout.max_calls)
        at = [1, 3, 4, 5] + [self.layout.call_offset(k) + j for k in range(calls) for j in range(3)]
        bits = np.ascontiguousarray(measured[:, at]).view(np.uint64)
        if (bits != bits[0]).any():
            return False
        coef = measured[:, 2]
        coef = coef[np.isfinite(coef)]
        dtypes = [GRAD_DTYPES[int(d)] for d in measured[:, 6] if math.isfinite(d)]
        rtol = max((NORM_RTOL_BY_DTYPE[d] for d in dtypes), default=max(NORM_RTOL_BY_DTYPE.values()))
        return not len(coef) or float(coef.max() - coef.min()) <= rtol * float(np.abs(coef).max())

    def _weight_check(self, step: int) -> bool:
        """Whether the replicas' weights are compared after this step (every weights_every-th checked step)."""
        return (step // self.every) % self.weights_every == 0

    def _drift_text(self, fault: ReplicaFault, step: int) -> str:
        """Replica weights that drifted apart: first seen at this weight check, after the last that agreed."""
        from ..ranksets import compact_ranks

        agreed = (
            f"they last agreed at step {self._weights_agreed_at}"
            if self._weights_agreed_at is not None
            else "no earlier weight check agreed"
        )
        since = self._weights_agreed_at if self._weights_agreed_at is not None else -1
        holders = set(fault.ranks) | set(fault.agreeing)
        skipped = [
            (s, ranks) for s, ranks in self.skipped_steps if since < s <= step and holders & set(ranks)
        ]
        if skipped:  # named when it happened: the weights differ since, with no fault of a device
            said = "; ".join(f"rank(s) {list(ranks)} skipped optimizer step {s}" for s, ranks in skipped)
            return (
                f"the weights of ranks {compact_ranks(sorted(holders))} over group {fault.group!r} differ after "
                f"the optimizer step ({agreed}) since {said}, as the guard said then: restore the replicas' "
                "weights from one rank or the last checkpoint"
            )
        if not fault.agreeing:
            return (
                f"the weights of ranks {compact_ranks(fault.ranks)} over group {fault.group!r} differ after the "
                f"optimizer step, and no majority agrees ({agreed}): a rank-local fault on one of them"
            )
        named = ", ".join(f"rank {r} ({self._places[r]})" for r in fault.ranks)
        return (
            f"a rank-local fault: the weights of {named} over group {fault.group!r} differ from its "
            f"replicas' (ranks {compact_ranks(fault.agreeing)}) after the optimizer step; first seen at "
            f"step {step}, {agreed}: suspect that device or a code path only that rank ran, restore its "
            "weights from a replica or the last checkpoint, and drain the node if it repeats"
        )

    def _fault_text(self, fault: ReplicaFault, step: int) -> str:
        """A copy that differs from its replicas': a rank-local fault, not the clipping code."""
        from ..ranksets import compact_ranks

        if not fault.agreeing:
            return (
                f"ranks {compact_ranks(fault.ranks)} hold copies over group {fault.group!r} that differ, and no "
                "majority agrees: a rank-local fault on one of them (its device, or a code path only it ran)"
            )
        named = ", ".join(f"rank {r} ({self._places[r]})" for r in fault.ranks)
        since = [s for s in self._faulty.get(fault.ranks[0], []) if s < step]
        persistent = f"; persistent: also at {_step_list(since)}" if since else ""
        replicas = len(fault.agreeing)
        return (
            f"a rank-local fault, not the clipping code: {named} holds a gradient copy over group "
            f"{fault.group!r} that differs from its {replicas} replica{'' if replicas == 1 else 's'} (rank"
            f"{'' if replicas == 1 else 's'} {compact_ranks(fault.agreeing)}), which agree: suspect that device "
            f"or a code path only that rank ran; re-run the step on it, and drain the node if it repeats{persistent}"
        )

    def _ask_where_nonfinite(self, rows: Any) -> None:
        """The parameters (and ranks) whose gradients were nonfinite before the step's first clip call,
        from the pieces each rank's row names (see summary.NONFINITE_SLOTS)."""
        at = self.layout.nonfinite_offset
        named: list[str] = []
        for rank, row in enumerate(rows):
            pieces = [int(i) for i in row[at : at + NONFINITE_SLOTS] if math.isfinite(i)]
            params = self._params_of[rank]
            names = dict.fromkeys(params[i] for i in pieces if 0 <= i < len(params))
            named.extend(f"{name} (rank {rank})" for name in names)
        self._nonfinite_in = named[:8]

    def _record_line(self, line: TrendLine) -> None:
        self.last = line
        if self.rank == 0:
            self._append_trend(line)
        if self.on_verdict is not None:
            self._call_back(self.on_verdict, line)

    def _append_trend(self, line: TrendLine) -> None:
        try:
            self._trend.append(line.to_text())
        except OSError as exc:
            self._cannot_write(self._trend.path, exc, "the trend")

    def _cannot_write(self, path: Path, exc: OSError, what: str) -> None:
        self._warn_once(
            f"write:{path}",
            f"gradaudit guard: cannot write {what} to {os.fspath(path)} ({exc.strerror or exc}); the guard "
            "goes on checking and writes again when it can: free space, or pass another out_dir",
        )

    def _call_back(self, callback: Callable[[TrendLine], None], line: TrendLine) -> None:
        try:
            callback(line)
        except Exception as exc:
            if _is_signal(exc):
                raise
            text = "".join(traceback.format_exception(exc)).rstrip()
            self._warn_once(
                f"callback:{type(exc).__name__}",
                f"gradaudit guard: on_verdict raised; the guard goes on:\n{text}",
            )

    def _dump(self, live: LiveStep, step: int, codes: tuple[str, ...]) -> bool:
        """Write this rank's file of the step (see `_rank_dump`), and arm a full capture of the next;
        False when the dump budget or the cooldown says no, or when the file cannot be written (warned)."""
        from ..dumpfile.writer import write_rank_file

        if self._num_dumped >= self.max_dumps:
            return False
        if self._last_dump_step is not None and step - self._last_dump_step < self.cooldown:
            return False
        # counted whether or not this rank's file gets written: every rank decides alike
        self._num_dumped += 1
        self._last_dump_step = step
        if self.capture_next:
            self._capture_step = self.step + 1  # late or not, the verdict is read before this step ends
        dump = self._safely("dump", lambda: self._stamped(self._rank_dump(live, codes)))
        if dump is None:
            return False
        try:
            self.dumps.append(write_rank_file(live.directory, dump, {}))
        except OSError as exc:
            self._cannot_write(Path(live.directory), exc, f"the dump of step {step}")
            return False
        except GradauditError as exc:  # a file left there by an earlier attempt, or refused by the reader
            self._warn_once(
                f"dump:{type(exc).__name__}", f"gradaudit guard: {exc}; the guard goes on checking"
            )
            return False
        return True

    def _stamped(self, dump: RankDump) -> RankDump:
        """`dump` as the guard writes it: where and by what it was made, and why."""
        return dataclasses.replace(
            dump,
            host=socket.gethostname(),
            torch_version=str(torch.__version__),
            gradaudit_version=__version__,
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            trigger=TRIGGER,
            trigger_note=(
                f"gradients nonfinite before the step's first clip call in {', '.join(self._nonfinite_in)}"
                if self._nonfinite_in
                else dump.trigger_note
            ),
        )

    def _rank_dump(self, live: LiveStep, codes: tuple[str, ...]) -> RankDump:
        """This rank's dump of the step: its ownership groups (`rank_dump`), or on a step whose
        replicas differ (GA601) its pieces of the parameters, so that `gradaudit check` of it names
        the parameters whose copies differ (spike_dump.params_rank_dump). Every rank decides alike,
        from the gathered numbers: the parameters' pieces when the norm is the 2-norm, and every rank
        made at most one clip call (its pieces' norms before it are what its group terms were summed
        from) and holds finite terms; else the groups."""
        dump = rank_dump(live, self.rank)
        ranks = live.ranks.values()
        if (
            "GA601" not in codes
            or self.norm_type != 2.0
            or any(r.num_calls > 1 or any(r.num_nan) or any(r.num_inf) for r in ranks)
            or not all(math.isfinite(term) for r in ranks for term in r.terms)
        ):
            return dump
        summary = live.ranks[self.rank]
        return params_rank_dump(
            dump,
            self._pieces,
            self._first_norms_of(live),
            coef=summary.applied_coef,
            grad_dtype=summary.grad_dtype,
        )

    def _first_norms_of(self, live: LiveStep) -> tuple[Any, tuple[int, ...]] | None:
        """This rank's per-piece 2-norms before the step's first clip call (on the host, float64), as
        its group terms were summed from them: divided by the loss scale where the clip call unscaled
        the gradients itself (see `_record_call`). None when they are not known, or do not sum to its
        terms (a scale the rows do not hold): its pieces are then dumped without statistics."""
        norms = self._said_of.get(live.step, ((), None))[1]
        if norms is None:
            return None
        values, present = norms
        values = values.detach().to("cpu", torch.float64)
        summary = live.ranks[self.rank]
        terms = torch.tensor(summary.terms, dtype=torch.float64)
        index = torch.tensor([self._summary.group_index[i] for i in present], dtype=torch.int64)
        for scale in dict.fromkeys((1.0, summary.loss_scale or 1.0)):
            scaled = values / scale
            sums = torch.zeros_like(terms).index_add_(0, index, scaled.square())
            if torch.allclose(sums, terms, rtol=1e-9, atol=0.0):
                return scaled, present
        return None

    def _begin_capture(self) -> None:
        from ..capture.session import AuditStep

        step, self._capture_step = self._capture_step, None
        if step is None or step != self.step:
            return
        self._capture = AuditStep(
            self.model if self._ownership is None else _no_parameters(),
            self._dump_dir / FULL_CAPTURES,
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

    def _safely(self, doing: str, action: Callable[[], Any]) -> Any:
        """Run a part of the guard's own work; a failure is one warning, and the guard goes on (a rank
        that cannot measure a step still sends its status: see `_take_part`)."""
        try:
            return action()
        except GuardAnomaly:
            raise
        except Exception as exc:
            if _is_signal(exc):
                raise
            self._warn_once(
                f"{doing}:{type(exc).__name__}",
                f"gradaudit guard: rank {self.rank} could not {doing} step {self.step}; training goes on "
                f"({_said(exc)})",
            )
            return None

    def _stop(self, reason: str, *, alone: bool = False) -> None:
        """Switch this rank's guard off, saying why (every rank reaches the same reason at the same
        step unless `alone`: this rank's own view, the others find theirs)."""
        if not self.active:
            return
        where = "on this rank" if alone else "on every rank"
        self._end_repeat()
        self._warn(
            f"gradaudit guard: {reason}; the guard is off {where} from step {self.step}; training goes on",
            shared=not alone,
        )
        self._switch_off()

    def _warn_once(self, key: str, message: str, *, shared: bool = False) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self._warn(message, shared=shared)

    def _warn(self, message: str, *, shared: bool = False) -> None:
        """Warn at the user's line (the clip call or the optimizer step that led here); a conclusion
        every rank `shared` is warned by rank 0 alone, and logged by the others at debug level."""
        import warnings

        from ..warn import user_stacklevel

        if shared and self.rank != 0:
            logging.getLogger(__name__).debug(message)
            return
        warnings.warn(message, GuardWarning, stacklevel=user_stacklevel(1, ("gradaudit", "torch")))

    def _end_repeat(self) -> None:
        """Say how long the anomaly warned last went on repeating, once it stops (or the guard does)."""
        repeat, self._repeat = self._repeat, None
        if repeat is None or not repeat[1]:
            return
        codes, again = repeat
        self._warn(f"gradaudit guard: {', '.join(codes)} again at {_step_list(again)}", shared=True)

    def _say_summary(self) -> None:
        """At removal: the anomalies of the whole run in one line, and the command that explains them."""
        self._end_repeat()
        if not self.anomalies:
            return
        by_codes: dict[tuple[str, ...], list[int]] = {}
        for step, codes in self.anomalies:
            by_codes.setdefault(codes, []).append(step)
        parts = [f"{', '.join(codes)} at {_step_list(steps)}" for codes, steps in by_codes.items()]
        count = len(self.anomalies)
        self._warn(
            f"gradaudit guard: {count} anomalous step{'' if count == 1 else 's'} of {self._num_judged} "
            f"checked: {'; '.join(parts)}; gradaudit check {os.fspath(self.out_dir)}",
            shared=True,
        )


_ATTACHED: weakref.WeakValueDictionary[int, Guard] = weakref.WeakValueDictionary()
"""The active guard of each optimizer (by id), so that a second guard of one is refused."""


def _attached_guard(model: Any, optimizer: Any) -> Guard | None:
    first = _ATTACHED.get(id(optimizer))
    if first is not None and first.active and first.optimizer is optimizer:
        return first
    for guard in list(_ATTACHED.values()):
        if guard.active and guard.model is model:
            return guard
    return None


_TORCH_CLIP_MODULES = ("torch.nn.utils", "torch.nn.utils.clip_grad")
"""Where torch's own clip_grad_norm_ is intercepted (capture/intercept.py): the call the guard's norm
pass is lent to."""


def user_site() -> str:
    """file:line of the first frame outside gradaudit and torch: the training code's line."""
    frame = sys._getframe(1)
    while frame.f_back is not None:
        name = frame.f_globals.get("__name__")
        ours = _OURS.get(name)
        if ours is None:
            ours = _OURS[name] = str(name).split(".")[0] in ("gradaudit", "torch")
        if not ours:
            break
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


_OURS: dict[Any, bool] = {}
"""Per module name met by user_site: whether it is gradaudit's or torch's."""


def _summary_at_exit(guard_ref: weakref.ref[Guard]) -> None:
    """A guard still attached when the process exits says what it found, as `remove()` would."""
    guard = guard_ref()
    if guard is not None and guard.active:
        guard._say_summary()


def _step_list(steps: list[int]) -> str:
    """ "step 7" or "steps 7, 9, 13-20": runs of consecutive steps folded."""
    from ..ranksets import compact_ranks

    return f"step{'' if len(set(steps)) == 1 else 's'} {compact_ranks(steps)}"


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _is_signal(exc: BaseException) -> bool:
    """An exception a signal handler raised to stop the process (torchelastic's SignalException is an
    Exception): it belongs to the training, and passes through the guard."""
    return type(exc).__name__ == "SignalException"


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


def _scales(scale: Any) -> bool:
    """Whether a loss scale divides out: a tensor's (not read, see ScalerWatch.scale_unread), or a
    positive number."""
    return isinstance(scale, torch.Tensor) or (scale is not None and scale > 0)


def _unscaled(terms: Any, sample: Any, scale: Any, norm_type: float, num_groups: int) -> tuple[Any, Any]:
    """Group terms (p-th powers of norms, then nonfinite counts) and a sample measured on gradients
    multiplied by the loss scale, as they are once it is divided out."""
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
    if line.true_norm is not None:  # with no clip call seen, the norm the optimizer stepped with
        parts.append(
            f"{'true norm' if line.reported_norm is not None else 'norm at the step'} {line.true_norm:.6g}"
        )
    if line.reported_norm is not None:
        parts.append(f"reported {line.reported_norm:.6g}")
    if line.last_reported_norm is not None and line.clip_calls > 1:  # what the logged ratio divides
        parts.append(f"{line.last_reported_norm:.6g} by the last of {line.clip_calls} clip calls")
    if line.expected_coef is not None and line.reported_norm is not None:
        parts.append(f"expected coefficient {line.expected_coef:.6g}")
    if line.min_coef is not None and line.max_coef is not None:
        parts.append(f"applied{by_last_call(line)} {line.min_coef:.6g}..{line.max_coef:.6g}")
    return f" ({', '.join(parts)})" if parts else ""


def _device_of(model: Any) -> Any:

    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        return local.device
    return torch.device("cpu")


def _no_parameters() -> torch.nn.Module:

    return torch.nn.Module()


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
