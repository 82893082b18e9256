"""Writing dumps from plain tensors and ownership metadata, for tests, benchmarks and custom trainers.

write_rank(step_dir, rank=0, world_size=2, step=7,
           params={"w": (4, 3)},
           pieces=[box("w", (0, 0), grad=g0)],
           clip=ClipRecord(max_norm=1.0, reported_norm=0.8))
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from ..dumpfile.dump import as_columns
from ..dumpfile.writer import write_rank_file
from ..model import (
    TENSOR_KINDS,
    Box,
    ClipRecord,
    DataRecord,
    FlatRange,
    ParamInfo,
    Piece,
    Region,
    TensorKind,
    TensorStats,
    Topology,
)
from .write import build_rank_dump

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack


@dataclass(frozen=True, kw_only=True)
class PieceSpec:
    """One local piece to write: where it lies in its parameter, and its tensors by kind."""

    param: str
    regions: tuple[Region, ...]
    tensors: Mapping[TensorKind, torch.Tensor]
    local_name: str | None = None
    replica_group: str | None = None
    stats_only: bool = False
    """Store float64 statistics of the tensors instead of their values."""
    call_stats: Sequence[TensorStats | torch.Tensor] = ()
    """Per clip call (two or more in the step), this piece's gradient just before it: a TensorStats, or a
    tensor shaped like the piece whose statistics are written."""

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError(f"piece of {self.param!r} has no tensors; give at least grad=")
        unknown = set(self.tensors) - set(TENSOR_KINDS)
        if unknown:
            raise ValueError(f"unknown tensor kinds {sorted(unknown)}; use {TENSOR_KINDS}")
        shapes = {tuple(t.shape) for t in self.tensors.values()}
        if len(shapes) != 1:
            raise ValueError(f"piece of {self.param!r}: tensors of different shapes {sorted(shapes)}")

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(next(iter(self.tensors.values())).shape)

    @property
    def dtype(self) -> str:
        return str(next(iter(self.tensors.values())).dtype).removeprefix("torch.")


class PieceOptions(TypedDict, total=False):
    """What `box`, `whole` and `flat` take besides the gradient: the other tensors, and the optional
    fields of a PieceSpec they pass through."""

    grad_clipped: torch.Tensor | None
    param_before: torch.Tensor | None
    param_after: torch.Tensor | None
    local_name: str | None
    replica_group: str | None
    stats_only: bool
    call_stats: Sequence[TensorStats | torch.Tensor]


def _spec(
    param: str, grad: torch.Tensor | None, options: PieceOptions, region: Callable[[torch.Tensor], Region]
) -> PieceSpec:
    """The PieceSpec of `param` holding the tensors given, its one region `region(first tensor)`."""
    fields: dict[str, Any] = dict(options)
    given = (grad, *(fields.pop(kind, None) for kind in TENSOR_KINDS[1:]))
    tensors = {kind: t for kind, t in zip(TENSOR_KINDS, given, strict=True) if t is not None}
    return PieceSpec(param=param, regions=(region(next(iter(tensors.values()))),), tensors=tensors, **fields)


def box(
    param: str, offsets: Sequence[int], grad: torch.Tensor | None = None, **kw: Unpack[PieceOptions]
) -> PieceSpec:
    """A piece that is the N-D block of `param` starting at `offsets`, shaped like its tensors."""
    return _spec(param, grad, kw, lambda t: Box(offsets=tuple(offsets), shape=tuple(t.shape)))


def whole(param: str, grad: torch.Tensor | None = None, **kw: Unpack[PieceOptions]) -> PieceSpec:
    """A piece holding all of `param` (a replica, or an unsharded parameter)."""
    return _spec(param, grad, kw, lambda t: Box(offsets=(0,) * t.dim(), shape=tuple(t.shape)))


def flat(param: str, start: int, grad: torch.Tensor | None = None, **kw: Unpack[PieceOptions]) -> PieceSpec:
    """A 1-D piece holding elements [start, start + numel) of the flattened `param`."""
    return _spec(param, grad, kw, lambda t: FlatRange(start=start, stop=start + t.numel()))


def write_rank(
    step_dir: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    step: int,
    params: Mapping[str, Sequence[int]],
    pieces: Sequence[PieceSpec],
    clip: ClipRecord | None = None,
    topology: Topology | None = None,
    data: DataRecord | None = None,
    aliases: Mapping[str, str] | None = None,
    run_id: str | None = None,
    host: str | None = None,
    created_at: str | None = None,
    norm_type: float | None = None,
    columnar: bool = True,
    share_params: bool = True,
    capture_api: str | None = None,
) -> Path:
    """Write one rank's file into `step_dir`. `params` maps names to global shapes (dtype taken
    from the first piece of each). `columnar=False` keeps stats-only
    pieces in the JSON header (format 1.0's form) instead of binary columns; `share_params=False`
    keeps a columnar file's parameter table in the file instead of the step's shared table file."""
    from .tensorstats import stats_of_tensor

    dtypes: dict[str, str] = {}
    for spec in pieces:
        dtypes.setdefault(spec.param, spec.dtype)
    infos = tuple(
        ParamInfo(name=name, global_shape=tuple(shape), dtype=dtypes.get(name, "float32"))
        for name, shape in params.items()
    )
    stats_norm_type = norm_type if norm_type is not None else (clip.norm_type if clip is not None else 2.0)
    model_pieces, payload = [], {}
    for index, spec in enumerate(pieces):
        stats = {}
        if spec.stats_only:
            stats = {kind: stats_of_tensor(t, stats_norm_type) for kind, t in spec.tensors.items()}
        else:
            payload.update({(index, kind): t for kind, t in spec.tensors.items()})
        model_pieces.append(
            Piece(
                index=index,
                param=spec.param,
                regions=spec.regions,
                local_shape=spec.local_shape,
                dtype=spec.dtype,
                local_name=spec.local_name,
                replica_group=spec.replica_group,
                stats=stats,
                call_stats=tuple(
                    s if isinstance(s, TensorStats) else stats_of_tensor(s, stats_norm_type)
                    for s in spec.call_stats
                ),
            )
        )
    all_stats = bool(pieces) and all(spec.stats_only for spec in pieces)
    dump = build_rank_dump(
        rank=rank,
        world_size=world_size,
        step=step,
        mode="stats" if all_stats else "full",
        params=infos,
        pieces=as_columns(infos, model_pieces),
        aliases=aliases or {},
        topology=topology or Topology(),
        clip=clip,
        data=data or DataRecord(),
        run_id=run_id,
        capture_api=capture_api,
        host=host,
        created_at=created_at,
    )
    return write_rank_file(step_dir, dump, payload, columnar=columnar, share_params=share_params)
