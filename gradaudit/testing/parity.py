"""`check_clip_parity`: the user's sharded step against the same step unsharded, audited, as one assertion.

    def test_my_fsdp_clips_like_one_process():
        check_clip_parity(build=build, parallelize=parallelize, make_batch=make_batch, step=step)

The callables are sent to fresh processes by reference, so they must be defined at module level in the
test file (or a package): not lambdas, not nested functions.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..localranks import DEFAULT_TIMEOUT_S, failure_text, launch, sendable

if TYPE_CHECKING:
    import torch

    from ..report.model import Finding, Report
    from .parity_ranks import ReferenceFacts, UnseenClips

LEARNING_RATE = 0.1
MAX_PARAMS_SHOWN = 6
FAIL_ON = ("error", "warning")
_SEVERITY_RANK = {"error": 0, "warning": 1, "info": 2}


class ParityFailure(AssertionError):
    """The sharded step did not clip like its unsharded reference; the message is the diagnosis."""


class ClipNotSeen(UserWarning):
    """A passing check whose step clipped with no call the check records (inline): judged from the
    gradients around it and the norm it returned; `clip=` would give each call's diagnosis."""


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The default optimizer: plain SGD, so that the next weights follow the clipped gradients simply."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def check_clip_parity(
    *,
    build: Callable[[], Any],
    parallelize: Callable[[Any, Any], Any],
    make_batch: Callable[[int, int], Any],
    step: Callable[[Any, Any, float], Any],
    world_size: int = 4,
    mesh: Mapping[str, int] | None = None,
    steps: int = 2,
    max_norm: float = 1.0,
    norm_type: float = 2.0,
    optimizer: Callable[[Any], Any] | None = sgd,
    clip: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
    reference_step: Callable[[Any, Any, float], Any] | None = None,
    data_axes: Sequence[str] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    fail_on: str = "warning",
    rank_specific_inputs: bool = True,
    out_dir: str | Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Report, ...]:
    """Run `step` on `world_size` gloo ranks (CPU) and on the unsharded model, audit every step against
    its reference, and return the reports (one per step); raise ParityFailure (an AssertionError) with
    the verdict and findings when they disagree.

    build(): a fresh model, the same weights every call (seed it). parallelize(model, mesh): the model
    sharded your way on `mesh` (a torch DeviceMesh). make_batch(rank, step): that rank's batch of step
    1, 2, ...; the reference gets the data-parallel ranks' batches joined along dim 0, so each rank's
    loss must be a mean over its own equal share. step(model, batch, max_norm): forward, backward and
    the clip, returning the norm it clipped with; the check steps the optimizer and zeroes the gradients.

    What fails, by finding code: the norm clipping used against the true global norm (GA201-GA210; a
    wrong returned norm with right coefficients, GA205, fails at fail_on="warning"); one coefficient on
    every rank, the expected one (GA301, GA302, GA303); the gradients, clipped gradients and next weights
    against the reference (GA602, GA603); any other finding at or above `fail_on` ("warning" or "error").
    Without a code: clipping that is vacuous on some step (the reference's pre-clip norm at most
    max_norm), identical batches on every data-parallel rank (they hide a missing average; allow with
    rank_specific_inputs=False), or fewer than two steps.

    mesh: {axis name: size} in order, e.g. {"dp": 2, "tp": 2}; None is {"dp": world_size}. data_axes:
    the axes over which ranks see different batches; None: the axes whose name starts with "dp" (ranks
    that differ only along other axes, a tensor-parallel group, must get the same batch).
    optimizer(model): an optimizer factory (None: no optimizer step, and no next weights compared).
    clip: the clipping function (or functions) the step calls, recorded wherever the step's module or
    the function's own module binds it; None: torch.nn.utils.clip_grad_norm_. A step that calls none of
    them (its clip written inline) is judged all the same, from the gradients after its last backward,
    the norm it returns and the gradients at the optimizer step, with a note saying so (in the failure,
    or a ClipNotSeen warning when it passes) and naming clip= for a precise diagnosis.
    reference_step: the step for the unsharded model when `step` only works sharded. rtol, atol: the
    reference comparison's tolerances (None: by dtype, as `gradaudit check --reference`). out_dir: where
    the dumps go (a fresh folder); None: a temporary folder, deleted when the check passes and kept
    (named in the message) when it fails.
    """
    __tracebackhide__ = True  # pytest shows the assertion, not this function's code
    mesh_axes = _mesh(mesh, world_size)
    axes = _data_axes(data_axes, mesh_axes)
    clips = _clips(clip)
    _check_numbers(steps=steps, max_norm=max_norm, norm_type=norm_type, fail_on=fail_on)
    named = {
        "build": build,
        "parallelize": parallelize,
        "make_batch": make_batch,
        "step": step,
        "optimizer": optimizer,
        "reference_step": reference_step,
    }
    for name, fn in [*named.items(), *(("clip", fn) for fn in clips)]:
        if fn is not None:
            if not callable(fn):
                raise UsageError(f"check_clip_parity: {name}= must be a function, got {type(fn).__name__}")
            sendable(f"check_clip_parity: {name}={getattr(fn, '__qualname__', fn)!r}", fn)
    root, temporary = _out_dir(out_dir)

    from .parity_ranks import ParitySpec, reference_process, sharded_rank

    spec = ParitySpec(
        build=build,
        parallelize=parallelize,
        make_batch=make_batch,
        step=step,
        reference_step=reference_step,
        optimizer=optimizer,
        clip=clips,
        mesh=mesh_axes,
        data_axes=axes,
        steps=steps,
        max_norm=float(max_norm),
        norm_type=float(norm_type),
        sharded_dir=str(root / "sharded"),
        reference_dir=str(root / "reference"),
    )
    kept = f"\n(the dumps are kept in {root})"
    outcomes = launch(sharded_rank, world_size, (spec,), timeout_s=timeout_s)
    failed = [o for o in outcomes if o.status != "ok"]
    if failed:
        raise ParityFailure(f"the sharded step failed on {world_size} ranks:\n{failure_text(failed)}{kept}")
    (reference,) = launch(reference_process, 1, (spec,), timeout_s=timeout_s, init_group=False)
    if reference.status != "ok":
        raise ParityFailure(f"the unsharded reference step failed:\n{failure_text([reference])}{kept}")
    facts: ReferenceFacts = reference.value
    problems = _input_problems(facts, rank_specific_inputs)
    if problems:
        raise ParityFailure("\n".join(problems) + kept)

    reports, reference_reports = _audit(root, steps, rtol=rtol, atol=atol)
    message = _judge(reports, reference_reports, max_norm=float(max_norm), fail_on=fail_on)
    note = _unseen_note(_unseen(outcomes), facts.unseen_clips, clips)
    if message:
        raise ParityFailure(message + (f"\n\n{note}" if note else "") + kept)
    if temporary:
        shutil.rmtree(root, ignore_errors=True)
    if note:
        warnings.warn(f"check_clip_parity passed; {note}", ClipNotSeen, stacklevel=2)
        reports = tuple(dataclasses.replace(r, warnings=(*r.warnings, note)) for r in reports)
    return reports


def _mesh(mesh: Mapping[str, int] | None, world_size: int) -> tuple[tuple[str, int], ...]:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"check_clip_parity: world_size must be a positive int, got {world_size!r}")
    if mesh is None:
        return (("dp", world_size),)
    if not isinstance(mesh, Mapping) or not mesh:
        raise UsageError(
            f'check_clip_parity: mesh= takes {{axis name: size}}, e.g. {{"dp": 2, "tp": 2}}, got {mesh!r}'
        )
    axes = tuple((str(name), size) for name, size in mesh.items())
    if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for _, s in axes):
        raise UsageError(f"check_clip_parity: mesh sizes must be positive ints, got {dict(axes)!r}")
    if math.prod(size for _, size in axes) != world_size:
        raise UsageError(
            f"check_clip_parity: mesh {dict(axes)!r} holds {math.prod(s for _, s in axes)} ranks but "
            f"world_size is {world_size}; make the sizes multiply to world_size"
        )
    return axes


def _data_axes(data_axes: Sequence[str] | None, mesh: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    names = [name for name, _ in mesh]
    if data_axes is None:
        return tuple(name for name in names if name.startswith("dp"))
    if isinstance(data_axes, str):
        data_axes = (data_axes,)
    unknown = [a for a in data_axes if a not in names]
    if unknown:
        raise UsageError(f"check_clip_parity: data_axes {unknown!r} are not axes of the mesh {names!r}")
    return tuple(data_axes)


def _clips(clip: Callable[..., Any] | Sequence[Callable[..., Any]] | None) -> tuple[Callable[..., Any], ...]:
    if clip is None:
        return ()
    if callable(clip):
        return (clip,)
    return tuple(clip)


def _check_numbers(*, steps: int, max_norm: float, norm_type: float, fail_on: str) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise UsageError(
            f"check_clip_parity: steps must be an int of at least 2, got {steps!r}: a single step can agree "
            "by chance (and the second starts from weights the first clipped step produced)"
        )
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise UsageError(f"check_clip_parity: max_norm must be a positive finite number, got {max_norm!r}")
    if not (isinstance(norm_type, (int, float)) and (norm_type > 0 or math.isinf(norm_type))):
        raise UsageError(f"check_clip_parity: norm_type must be positive or inf, got {norm_type!r}")
    if fail_on not in FAIL_ON:
        raise UsageError(f"check_clip_parity: fail_on must be 'error' or 'warning', got {fail_on!r}")


def _out_dir(out_dir: str | Path | None) -> tuple[Path, bool]:
    if out_dir is None:
        return Path(tempfile.mkdtemp(prefix="gradaudit-parity-")), True
    root = Path(out_dir)
    taken = [root / name for name in ("sharded", "reference") if (root / name).exists()]
    if taken:
        raise UsageError(
            f"check_clip_parity: {taken[0]} already exists and dumps are never overwritten; "
            "pass a fresh out_dir (pytest's tmp_path) or none"
        )
    return root, False


def _input_problems(facts: ReferenceFacts, rank_specific_inputs: bool) -> list[str]:
    problems = []
    if facts.build_differs:
        problems.append(
            "build() gave different weights on two calls; seed it (torch.manual_seed) so that every rank and "
            "the reference start from the same model"
        )
    if facts.mismatched:
        step, rank, rep = facts.mismatched[0]
        problems.append(
            f"make_batch() gave rank {rank} a different batch from rank {rep} on step {step}, although they "
            "share a data-parallel coordinate (a tensor-parallel group sees one batch); return the batch "
            "of the data-parallel coordinate, or name the axes that split the data with data_axes="
        )
    if facts.identical_steps and rank_specific_inputs:
        ranks = ", ".join(str(r) for r in facts.data_ranks)
        steps = ", ".join(str(s) for s in facts.identical_steps)
        problems.append(
            f"make_batch() gave the data-parallel ranks {ranks} identical batches on step {steps}: identical "
            "inputs hide a missing gradient average, so the check needs rank-specific batches (seed the data "
            "with the rank), or pass rank_specific_inputs=False"
        )
    return problems


def _unseen(outcomes: Sequence[Any]) -> UnseenClips:
    """The sharded steps on which some rank saw no clip call."""
    from .parity_ranks import UnseenClips

    unseen = UnseenClips()
    for outcome in outcomes:
        unseen |= outcome.value
    return unseen


def _unseen_note(sharded: UnseenClips, reference: UnseenClips, clips: Sequence[Callable[..., Any]]) -> str:
    """What the check could not see of a step that clipped inline, and how to let it; "" when it saw
    a clip call on every step."""
    runs = [(name, u) for name, u in (("sharded", sharded), ("reference", reference)) if u.steps]
    if not runs:
        return ""
    names = (
        ", ".join(f"{fn.__module__}.{fn.__qualname__}" for fn in clips) or "torch.nn.utils.clip_grad_norm_"
    )
    where = "; ".join(f"{name} step{_s(u.steps)} {_steps(u.steps)}" for name, u in runs)
    note = (
        f"note: no clip call was seen ({where}): step() called none of the clipping functions the check "
        f"records ({names}). Its clipping was judged from the gradients after its last backward, the norm "
        "it returned as the norm it clipped with, and the gradients at the optimizer step; each clip call's "
        "own gradients and norm (a clip per micro-batch, GA501) are not seen so. For a precise diagnosis "
        "pass the function your step clips with as clip= (defined at module level, called by its name)"
    )
    without = sorted({s for _, u in runs for s in u.without_norm})
    if without:
        note += (
            f". step() returned no norm on step{_s(without)} {_steps(without)}: the norm it clipped with is "
            "not diagnosed there (GA201-GA210); return it"
        )
    return note


def _s(items: Sequence[Any]) -> str:
    return "" if len(items) == 1 else "s"


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps))


def _audit(
    root: Path, steps: int, *, rtol: float | None, atol: float | None
) -> tuple[tuple[Report, ...], tuple[Report, ...]]:
    from ..audit import audit_step_dir
    from ..checks.base import AuditOptions

    reports, references = [], []
    for step in range(1, steps + 1):
        reference_dir = root / "reference" / f"step_{step}"
        options = AuditOptions(reference=str(reference_dir), rtol=rtol, atol=atol)
        reports.append(audit_step_dir(root / "sharded" / f"step_{step}", options))
        references.append(audit_step_dir(reference_dir, AuditOptions()))
    return tuple(reports), tuple(references)


def _judge(reports: Sequence[Report], references: Sequence[Report], *, max_norm: float, fail_on: str) -> str:
    """The failure message, or "" when every step clipped, and clipped like its reference."""
    threshold = _SEVERITY_RANK[fail_on]
    parts = []
    vacuous = [r for r in references if r.global_norm is not None and r.global_norm <= max_norm]
    if vacuous:
        norms = ", ".join(
            f"{r.global_norm:.6g} (step {r.step})" for r in vacuous if r.global_norm is not None
        )
        smallest = min(r.global_norm for r in vacuous if r.global_norm is not None)
        parts.append(
            f"clipping is vacuous: the unsharded reference's pre-clip norm is {norms}, not above max_norm "
            f"{max_norm:g}, so the step did not clip and the check cannot tell a right clip coefficient from "
            f"a wrong one; pass a max_norm below the norm (e.g. max_norm={smallest / 2:.3g}) or make the "
            "gradients larger"
        )
    audited = [(f"unsharded reference, step {r.step}", r) for r in references]
    audited += [(f"step {r.step}", r) for r in reports]
    shown_in_full = False
    for title, report in audited:
        serious = [f for f in report.findings if _SEVERITY_RANK[f.severity.value] <= threshold]
        if serious:
            # Later steps start from the weights the first wrong step made: their findings are mostly its
            # consequences, so only the first is spelled out.
            parts.append(_step_text(title, report, serious, in_full=not shown_in_full))
            shown_in_full = True
    if not parts:
        return ""
    num_failing = sum(any(_SEVERITY_RANK[f.severity.value] <= threshold for f in r.findings) for r in reports)
    world = reports[0].world_size
    head = (
        f"gradaudit: the sharded step on {world} ranks does not clip like the unsharded reference on "
        f"{num_failing} of {len(reports)} steps"
        if num_failing
        else f"gradaudit: clipping parity on {world} ranks is not established"
    )
    return head + "\n\n" + "\n\n".join(parts)


def _step_text(title: str, report: Report, findings: Sequence[Finding], *, in_full: bool) -> str:
    from ..checks.base import num

    lines = [f"{title}: ✗ {report.verdict}"]
    if not in_full:
        codes = sorted({f.code for f in findings})
        return "\n".join(lines + [f"  findings: {', '.join(codes)}", f"  reproduce: {report.command}"])
    lines += [f"  {line}" for f in findings for line in _finding_lines(f)]
    lines.append("  ranks:")
    lines += [
        f"    rank {row.rank}: local norm {num(row.local_norm)}, reported norm {num(row.reported_norm)}, "
        f"applied coefficient {num(row.applied_clip_coef)}" + (f" ({row.diagnosis})" if row.diagnosis else "")
        for row in report.ranks
    ]
    lines.append(f"  reproduce: {report.command}")
    return "\n".join(lines)


def _finding_lines(finding: Finding) -> list[str]:
    lines = [f"{finding.code} {finding.severity.value}: {finding.message}"]
    if finding.params:
        shown = ", ".join(finding.params[:MAX_PARAMS_SHOWN])
        more = len(finding.params) - MAX_PARAMS_SHOWN
        lines.append(f"    parameters: {shown}" + (f" and {more} more" if more > 0 else ""))
    return lines
