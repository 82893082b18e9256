"""What `check_clip_parity` runs inside its processes: the user's step on each sharded rank, and the same
steps on the unsharded model in one process. Loaded only there (it imports torch)."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

import gradaudit

from ..errors import UsageError

if TYPE_CHECKING:
    from ..capture.session import AuditStep

TORCH_CLIPS: tuple[Callable[..., Any], ...] = (torch.nn.utils.clip_grad_norm_,)
"""Resolved when this module loads, before any audit begins: a binding that something else replaced
meanwhile (a wrapper of its own) is left to whoever replaced it, not wrapped a second time."""


@dataclass(frozen=True, kw_only=True)
class ParitySpec:
    """Everything the processes need, sent to each of them (callables by reference)."""

    build: Callable[[], torch.nn.Module]
    """Builds the unsharded model (same seed on every rank)."""
    parallelize: Callable[[torch.nn.Module, Any], torch.nn.Module]
    """Shards the model over the device mesh it is given."""
    make_batch: Callable[[int, int], Any]
    """(rank, step) -> that rank's batch of that step (steps from 1)."""
    step: Callable[[torch.nn.Module, Any, float], Any]
    """(model, batch, max_norm): forward, backward and the clip; returns the norm it clipped with."""
    reference_step: Callable[[torch.nn.Module, Any, float], Any] | None
    """The step for the unsharded model when `step` only works sharded; None: `step`."""
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None
    """Builds the optimizer; None: no optimizer step, no next weights compared."""
    clip: tuple[Callable[..., Any], ...]
    """The clipping functions the step calls; empty: torch.nn.utils.clip_grad_norm_."""
    mesh: tuple[tuple[str, int], ...]
    """(axis name, size) in mesh order; their product is the world size."""
    data_axes: tuple[str, ...]
    """Mesh axes over which the ranks see different batches."""
    steps: int
    """Training steps to run and compare."""
    max_norm: float
    """The clipping threshold."""
    norm_type: float
    """`p` of the clip norm."""
    sharded_dir: str
    """Where the sharded run's dumps go."""
    reference_dir: str
    """Where the reference run's dumps go."""


@dataclass(frozen=True, kw_only=True)
class UnseenClips:
    """The steps of one run (the sharded ranks', or the reference's) on which no clip call was seen."""

    steps: tuple[int, ...] = ()
    """Steps whose clipping was inline (or absent): judged from the gradients after the last backward
    and the norm step() returned."""
    without_norm: tuple[int, ...] = ()
    """Those of them on which step() returned no norm either."""

    def __or__(self, other: UnseenClips) -> UnseenClips:
        return UnseenClips(
            steps=tuple(sorted({*self.steps, *other.steps})),
            without_norm=tuple(sorted({*self.without_norm, *other.without_norm})),
        )


@dataclass(frozen=True, kw_only=True)
class ReferenceFacts:
    """What the reference process learned about the user's inputs, for the caller to judge."""

    data_ranks: tuple[int, ...]
    """The ranks whose batches make up the global batch (one per data-parallel coordinate)."""
    identical_steps: tuple[int, ...]
    """Steps on which every data-parallel rank got the same batch."""
    mismatched: tuple[tuple[int, int, int], ...]
    """(step, rank, its data-parallel representative) where two ranks that share a data-parallel
    coordinate (a tensor-parallel group) got different batches."""
    build_differs: bool
    """Two calls of build() gave different weights."""
    unseen_clips: UnseenClips = UnseenClips()
    """The reference's steps on which no clip call was seen."""


def sharded_rank(rank: int, world_size: int, spec: ParitySpec) -> UnseenClips:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        "cpu", tuple(size for _, size in spec.mesh), mesh_dim_names=tuple(name for name, _ in spec.mesh)
    )
    model = spec.parallelize(spec.build(), mesh)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"parallelize() returned {type(model).__name__}, not the model; return the module it sharded"
        )
    optimizer = None if spec.optimizer is None else spec.optimizer(model)
    unseen = UnseenClips()
    for step in range(1, spec.steps + 1):
        unseen |= audited_step(
            model, optimizer, spec.make_batch(rank, step), spec, step, spec.sharded_dir, spec.step
        )
    return unseen


def reference_process(rank: int, world_size: int, spec: ParitySpec) -> ReferenceFacts:
    facts: ReferenceFacts = gradaudit.run_reference(_reference_steps, spec)
    return facts


def _reference_steps(spec: ParitySpec) -> ReferenceFacts:
    model = spec.build()
    build_differs = not _same_state(model.state_dict(), spec.build().state_dict())
    optimizer = None if spec.optimizer is None else spec.optimizer(model)
    representative = data_representatives(spec.mesh, spec.data_axes)
    data_ranks = tuple(sorted(set(representative)))
    identical, mismatched = [], []
    unseen = UnseenClips()
    for step in range(1, spec.steps + 1):
        batches = [spec.make_batch(rank, step) for rank in range(len(representative))]
        mismatched += [
            (step, rank, rep)
            for rank, rep in enumerate(representative)
            if rank != rep and not same_batch(batches[rank], batches[rep])
        ]
        if len(data_ranks) > 1 and all(same_batch(batches[r], batches[data_ranks[0]]) for r in data_ranks):
            identical.append(step)
        global_batch = concat_batches([batches[r] for r in data_ranks])
        unseen |= audited_step(
            model, optimizer, global_batch, spec, step, spec.reference_dir, spec.reference_step or spec.step
        )
    return ReferenceFacts(
        data_ranks=data_ranks,
        identical_steps=tuple(identical),
        mismatched=tuple(mismatched),
        build_differs=build_differs,
        unseen_clips=unseen,
    )


def audited_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    batch: Any,
    spec: ParitySpec,
    step: int,
    out_dir: str,
    step_fn: Callable[[torch.nn.Module, Any, float], Any],
) -> UnseenClips:
    """The user's step inside an audit of it: its clip calls recorded, then the optimizer step. A step
    that calls none of the recorded clipping functions (a clip written inline) is audited all the same:
    the gradients after its last backward are its pre-clip gradients, the norm it returns the norm it
    clipped with, the gradients at the optimizer step the clipped ones; returned so, it is named."""
    with gradaudit.audit_step(
        model,
        out_dir,
        step=step,
        max_norm=spec.max_norm,
        norm_type=spec.norm_type,
        optimizer=optimizer,
        strict=True,
    ) as audit:
        for owner, name in clip_sites(spec.clip or TORCH_CLIPS, step_fn):
            audit.intercept_clip(owner, name)
        with _gradients_after_each_backward(audit):
            returned = step_fn(model, batch, spec.max_norm)
        seen = bool(audit.reported_norms)
        if returned is not None and (not seen or audit.reported_norms[-1] is None):
            audit.record(reported_norm=returned)
        if optimizer is not None:
            optimizer.step()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    else:
        model.zero_grad(set_to_none=True)
    if seen:
        return UnseenClips()
    return UnseenClips(steps=(step,), without_norm=(step,) if returned is None else ())


@contextlib.contextmanager
def _gradients_after_each_backward(audit: AuditStep) -> Iterator[None]:
    """Record the gradients as each backward leaves them (FSDP2's reduce-scatter included: it ends
    inside the backward call) until the first clip call is recorded, which takes its own: the pre-clip
    gradients of a step whose clip no call shows."""
    original = torch.autograd.backward

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if not audit.reported_norms:
            audit.take_gradients(clipped=False)
        return result

    torch.autograd.backward = backward  # Tensor.backward looks it up here at each call
    try:
        yield
    finally:
        torch.autograd.backward = original


def clip_sites(clips: Sequence[Callable[..., Any]], step_fn: Callable[..., Any]) -> Iterator[tuple[Any, str]]:
    """Every (module, name) bound to one of `clips` in the modules a step reaches them through: the
    module defining the step, each clip function's own module, and torch.nn.utils for torch's."""
    owners = [sys.modules.get(getattr(step_fn, "__module__", "") or "")]
    owners += [sys.modules.get(getattr(fn, "__module__", "") or "") for fn in clips]
    owners += [sys.modules.get("torch.nn.utils"), sys.modules.get("torch.nn.utils.clip_grad")]
    seen: set[tuple[int, str]] = set()
    for owner in owners:
        if owner is None:
            continue
        for name, value in list(vars(owner).items()):
            if any(value is fn for fn in clips) and (id(owner), name) not in seen:
                seen.add((id(owner), name))
                yield owner, name


def data_representatives(mesh: Sequence[tuple[str, int]], data_axes: Sequence[str]) -> list[int]:
    """For each rank, the rank with the same data-parallel coordinates and 0 on every other axis: the
    one whose batch stands for its whole (tensor-parallel) group in the global batch."""
    sizes = [size for _, size in mesh]
    world_size = 1
    for size in sizes:
        world_size *= size
    representatives = []
    for rank in range(world_size):
        coords, rest = [], rank
        for size in reversed(sizes):
            coords.append(rest % size)
            rest //= size
        coords.reverse()
        kept = [c if name in data_axes else 0 for (name, _), c in zip(mesh, coords, strict=True)]
        index = 0
        for size, c in zip(sizes, kept, strict=True):
            index = index * size + c
        representatives.append(index)
    return representatives


def same_batch(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_batch(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_batch(a[k], b[k]) for k in a)
    return bool(a == b)


def concat_batches(batches: Sequence[Any]) -> Any:
    """The data-parallel ranks' batches joined in rank order along dim 0, leaf by leaf."""
    first = batches[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(batches), dim=0)
    if isinstance(first, (tuple, list)):
        joined = [concat_batches(parts) for parts in zip(*batches, strict=True)]
        return (
            type(first)(joined) if isinstance(first, list) or type(first) is tuple else type(first)(*joined)
        )
    if isinstance(first, Mapping):
        return {key: concat_batches([b[key] for b in batches]) for key in first}
    if all(same_batch(b, first) for b in batches):
        return first
    raise UsageError(
        f"make_batch() returned {type(first).__name__} values that differ between ranks and cannot be joined "
        "into the reference's global batch; return tensors, or tuples, lists or dicts of them"
    )


def _same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
