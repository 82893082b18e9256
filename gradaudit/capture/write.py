"""Turn what one rank captured into a RankDump and its tensors, and write the rank file."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from ..dumpfile.writer import step_dir, write_rank_file
from ..model import (
    ClipRecord,
    DataRecord,
    Mode,
    ParamInfo,
    Piece,
    RankDump,
    TensorKind,
    TensorStats,
    Topology,
)
from ..version import __version__
from .snapshots import Snapshots

if TYPE_CHECKING:
    import torch


def build_rank_dump(
    snapshots: Snapshots,
    *,
    rank: int,
    world_size: int,
    step: int,
    mode: Mode,
    topology: Topology,
    aliases: Mapping[str, str],
    clip: ClipRecord | None,
    data: DataRecord,
    run_id: str | None,
    call_stats: Mapping[int, tuple[TensorStats, ...]] | None = None,
    capture_api: str | None = None,
) -> tuple[RankDump, dict[tuple[int, TensorKind], torch.Tensor]]:
    """The RankDump (pieces numbered densely) and its tensors keyed by (piece index, kind), as CPU-bound copies."""
    infos: dict[str, ParamInfo] = {}
    pieces: list[Piece] = []
    tensors: dict[tuple[int, TensorKind], torch.Tensor] = {}
    for source_index, local in enumerate(snapshots.pieces):
        if local.param in snapshots.not_captured:
            continue
        failed = source_index in snapshots.failed
        kinds = snapshots.kinds_of(source_index)
        if failed or kinds:
            # A piece that failed keeps its parameter listed, so the checker reports the gap; one
            # without any gradient (frozen, or unused this step) leaves no trace.
            info = ParamInfo(name=local.param, global_shape=local.global_shape, dtype=local.dtype)
            infos.setdefault(local.param, info)
        if failed or not kinds:
            continue
        index = len(pieces)
        # Looked up by (piece, kind): a scan of every snapshot per piece grew with the square of the
        # rank's parameter count (13 s at 8,000 parameters).
        stats = {k: snapshots.stats[(source_index, k)] for k in kinds if (source_index, k) in snapshots.stats}
        for kind in kinds:
            value = snapshots.values.get((source_index, kind))
            if value is not None:
                tensors[(index, kind)] = _as_dtype(value, local.dtype)
        pieces.append(
            Piece(
                index=index,
                param=local.param,
                regions=local.regions,
                local_shape=local.local_shape,
                dtype=local.dtype,
                local_name=local.local_name,
                replica_group=local.replica_group,
                stats=stats,
                call_stats=(call_stats or {}).get(source_index, ()),
                partial_group=snapshots.partial.get(source_index),
            )
        )
    dump = RankDump(
        path="",
        rank=rank,
        world_size=world_size,
        step=step,
        mode=mode,
        run_id=run_id,
        host=socket.gethostname(),
        torch_version=_torch_version(),
        gradaudit_version=__version__,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        params=tuple(sorted(infos.values(), key=lambda i: i.name)),
        pieces=tuple(pieces),
        aliases=dict(aliases),
        topology=topology,
        clip=clip,
        data=data,
        not_captured=tuple(snapshots.not_captured[name] for name in sorted(snapshots.not_captured)),
        capture_api=capture_api,
    )
    return dump, tensors


def write_dump(
    out_dir: str | os.PathLike[str], dump: RankDump, tensors: Mapping[tuple[int, TensorKind], torch.Tensor]
) -> Path:
    """Write the rank file under out_dir/step_<N>/ (temporary name, then linked; never overwrites)."""
    return write_rank_file(step_dir(out_dir, dump.step), dump, tensors)


def _as_dtype(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    if str(tensor.dtype).removeprefix("torch.") == dtype:
        return tensor
    import torch

    return tensor.to(getattr(torch, dtype))


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
