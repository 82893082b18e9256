"""Turn what one rank captured into a RankDump and its tensors, and write the rank file."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, cast

import numpy as np
import torch

from ..dumpfile.columnar import ColumnarPieces, pieces_from_rows
from ..dumpfile.dump import RankDump, as_columns
from ..model import (
    Box,
    ClipRecord,
    DataRecord,
    FlatRange,
    Mode,
    NotCapturedParam,
    ParamInfo,
    Piece,
    Region,
    TensorKind,
    TensorStats,
    Topology,
    numel_of,
)
from ..version import __version__
from .plain import WholeRows, dtype_name
from .snapshots import Snapshots, collection_paused


def captured_pieces(
    snapshots: Snapshots, *, mode: Mode, call_stats: Mapping[int, tuple[TensorStats, ...]] | None = None
) -> tuple[tuple[ParamInfo, ...], ColumnarPieces, dict[tuple[int, TensorKind], torch.Tensor]]:
    """(the parameters, the pieces numbered densely, their tensors keyed by (piece index, kind) as
    CPU-bound copies) of what one rank captured.

    A stats dump that format 1.1 can hold as columns gets its pieces as a ColumnarPieces built from
    the snapshots' own rows (`_columnar`), with no Piece or TensorStats object per piece."""
    infos: dict[str, ParamInfo] = {}
    tensors: dict[tuple[int, TensorKind], torch.Tensor] = {}
    with collection_paused():
        columns = None if snapshots.values or call_stats or mode != "stats" else _columnar(snapshots)
        if columns is not None:
            return (*columns, tensors)
        objects = _pieces(snapshots, infos, tensors, call_stats)  # fills infos
        params = tuple(sorted(infos.values(), key=lambda i: i.name))
        return params, as_columns(params, objects), tensors


def build_rank_dump(
    *,
    rank: int,
    world_size: int,
    step: int,
    mode: Mode,
    params: tuple[ParamInfo, ...],
    pieces: ColumnarPieces,
    aliases: Mapping[str, str],
    topology: Topology,
    clip: ClipRecord | None,
    data: DataRecord,
    run_id: str | None,
    capture_api: str | None,
    not_captured: tuple[NotCapturedParam, ...] = (),
    host: str | None = None,
    created_at: str | None = None,
) -> RankDump:
    """The RankDump of one rank's step, stamped with where and when it was made (this host, the
    running torch and gradaudit, now) unless `host` or `created_at` say otherwise."""
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return RankDump(
        path="",
        rank=rank,
        world_size=world_size,
        step=step,
        mode=mode,
        run_id=run_id,
        host=host if host is not None else socket.gethostname(),
        torch_version=str(torch.__version__),
        gradaudit_version=__version__,
        created_at=created_at if created_at is not None else now,
        params=params,
        pieces=pieces,
        aliases=dict(aliases),
        topology=topology,
        clip=clip,
        data=data,
        not_captured=not_captured,
        capture_api=capture_api,
    )


def _pieces(
    snapshots: Snapshots,
    infos: dict[str, ParamInfo],
    tensors: dict[tuple[int, TensorKind], torch.Tensor],
    call_stats: Mapping[int, tuple[TensorStats, ...]] | None,
) -> list[Piece]:
    """The general path: a Piece per captured piece (values, call statistics, partial sums, anything
    the columns cannot hold); fills `infos` and `tensors`."""
    pieces: list[Piece] = []
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
        stats = {k: found for k in kinds if (found := snapshots.stats.get((source_index, k))) is not None}
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
    return pieces


def _columnar(snapshots: Snapshots) -> tuple[tuple[ParamInfo, ...], ColumnarPieces] | None:
    """(the parameters, the pieces as format-1.1 columns) of a stats-only capture, built from the
    snapshots' statistics rows as they are, the whole replicas' from their columns; None when a
    piece needs the general path (several regions, a local name, a dtype other than its
    parameter's, kinds differing between pieces, a 0-D box, a region that does not match its tensor)."""
    table = snapshots.stats
    kinds = [k for k in snapshots.kinds_taken if k in table.present and table.present[k].any()]
    if not kinds or snapshots.failed:
        return None
    present = [table.present[k] for k in kinds]
    held = np.logical_or.reduce(present)
    pieces = snapshots.pieces
    columns = _Columns()
    positions = np.flatnonzero(held)
    whole = pieces.whole
    is_whole = np.zeros(len(pieces), dtype=bool)
    if whole is not None:
        is_whole[whole.positions] = True
    # Runs of rows alike, in order: the whole rows' columns are made a run at a time.
    flags = is_whole[positions]
    for run in np.split(positions, np.flatnonzero(np.diff(flags)) + 1):
        if not run.size:
            continue
        if whole is not None and is_whole[run[0]]:
            added = columns.add_whole(snapshots, whole, np.searchsorted(whole.positions, run))
        else:
            added = columns.add_rows(snapshots, run.tolist())
        if not added:
            return None
    kept = columns.kept
    if not kept or any(not p[kept].all() for p in present):
        return None  # no piece, or kinds that differ between pieces
    params = columns.table()
    return params, pieces_from_rows(
        params=params,
        param_names=columns.names,
        groups=columns.groups,
        ndims=cast("Sequence[int]", columns.column("ndims")),  # int64 arrays, as pieces_from_rows makes them
        coords=cast("Sequence[int]", columns.column("coords")),
        rows={k: table.rows[k][kept] for k in kinds},
        norm_type=snapshots.norm_type,
    )


class _Columns:
    """The lists `pieces_from_rows` takes, filled piece by piece or, for the whole rows, a run at a
    time."""

    def __init__(self) -> None:
        self.infos: dict[str, ParamInfo] = {}
        self.kept: list[int] = []
        self.names: list[str] = []
        self.groups: list[str | None] = []
        self._blocks: dict[str, list[np.ndarray]] = {"ndims": [], "coords": []}
        """The ndims and coords columns as int64 arrays, a run of pieces each."""
        self.known_table: _KnownTable | None = None
        """The cached table of the whole rows added (`_last_table`), when one was used or made."""
        self._layouts: dict[int, tuple[int, tuple[int, ...], tuple[int, ...] | int] | None] = {}
        """id of a piece's regions -> (ndim: 0 for a flat range, its coordinates, the local shape or
        numel it needs), None when the columns cannot hold them: pieces of one shape share them."""

    def _whole_infos(
        self, names: list[str], codes: np.ndarray, kinds: Sequence[tuple[Any, ...]]
    ) -> list[ParamInfo]:
        """The ParamInfo of each whole row, those of the step before when it had the same ones."""
        key = (tuple(names), codes.tobytes(), tuple(kinds))
        known = _last_table.get(key)
        if known is not None:
            self.known_table = known
            return known.infos
        shapes = [kind[0] for kind in kinds]
        dtypes = [dtype_name(kind[1]) for kind in kinds]
        code_list = codes.tolist()
        made = list(
            map(_param_info, names, map(shapes.__getitem__, code_list), map(dtypes.__getitem__, code_list))
        )
        _last_table.clear()
        self.known_table = _last_table[key] = _KnownTable(infos=made)
        return made

    def table(self) -> tuple[ParamInfo, ...]:
        """The parameters, sorted by name (the table of the step before when it is the same)."""
        known = self.known_table
        if known is not None and known.params is not None and len(known.params) == len(self.infos):
            return known.params
        infos = self.infos
        params = tuple(map(infos.__getitem__, sorted(infos)))
        if known is not None and len(known.infos) == len(params):
            known.params = params
        return params

    def column(self, name: str) -> np.ndarray:
        """The "ndims" or "coords" column of every piece added, in order."""
        return np.concatenate(self._blocks[name])

    def add_rows(self, snapshots: Snapshots, indices: Sequence[int]) -> bool:
        infos, layouts = self.infos, self._layouts
        not_captured, pieces = snapshots.not_captured, snapshots.pieces
        ndims: list[int] = []
        coords: list[int] = []
        for index in indices:
            name = pieces.params[index]
            if name in not_captured:
                continue
            dtype, regions = pieces.dtypes[index], pieces.regions[index]
            info = infos.get(name)
            if info is None:
                infos[name] = ParamInfo(name=name, global_shape=pieces.global_shapes[index], dtype=dtype)
            elif info.dtype != dtype:
                return False
            key = id(regions)
            layout = layouts[key] if key in layouts else layouts.setdefault(key, _layout(regions))
            if layout is None or pieces.local_names[index] is not None:
                return False
            ndim, values, needs = layout
            local_shape = pieces.local_shapes[index]
            if needs != (local_shape if ndim else numel_of(local_shape)):
                return False
            self.kept.append(index)
            self.names.append(name)
            self.groups.append(pieces.replica_groups[index])
            ndims.append(ndim)
            coords += values
        self._blocks["ndims"].append(np.array(ndims, dtype=np.int64))
        self._blocks["coords"].append(np.array(coords, dtype=np.int64))
        return True

    def add_whole(self, snapshots: Snapshots, whole: WholeRows, chosen_rows: np.ndarray) -> bool:
        """The whole rows at `chosen_rows` (indices among them): one whole box each, its parameter's
        ParamInfo filled in directly (their shapes are real tensors')."""
        kinds = whole.kinds
        if any(not shape for shape, _, _ in kinds):
            return False  # a 0-D box
        if snapshots.not_captured:
            names = whole.names
            chosen_rows = np.array(
                [j for j in chosen_rows.tolist() if names[j] not in snapshots.not_captured], dtype=np.int64
            )
        chosen = chosen_rows.tolist()
        every = len(chosen) == len(whole.names)
        names = list(whole.names) if every else [whole.names[j] for j in chosen]
        codes = whole.codes if every else whole.codes[chosen_rows]
        shapes = [kind[0] for kind in kinds]
        before = len(self.infos)
        self.infos.update(zip(names, self._whole_infos(names, codes, kinds), strict=True))
        if len(self.infos) != before + len(chosen):
            return False  # a name another piece has too: the general checks decide
        ndims = np.array([len(shape) for shape in shapes], dtype=np.int64)
        boxes = np.zeros((len(kinds), 2 * int(ndims.max())), dtype=np.int64)
        for code, shape in enumerate(shapes):
            boxes[code, len(shape) : 2 * len(shape)] = shape
        laid_out = np.arange(boxes.shape[1]) < 2 * ndims[:, None]
        positions = whole.positions[chosen_rows].tolist()
        self.kept += positions
        self.names += names
        self.groups += [snapshots.pieces.replica_groups[i] for i in positions]
        self._blocks["ndims"].append(ndims[codes])
        self._blocks["coords"].append(boxes[codes][laid_out[codes]])
        return True


@dataclass
class _KnownTable:
    """The whole rows' ParamInfo list of a step, and its sorted parameter table when they were
    all of it: a step like the one before reuses them, and the reader's checks find the table they
    validated last (10^5 parameters a rank happen)."""

    infos: list[ParamInfo]
    """The whole rows' ParamInfo, in the order they were added."""
    params: tuple[ParamInfo, ...] | None = None
    """The step's whole parameter table, when it held the whole rows alone."""


_last_table: dict[tuple[Any, ...], _KnownTable] = {}
"""(names, codes, kinds) of the last step's whole rows -> their table (one entry at most)."""


def _param_info(name: str, shape: tuple[int, ...], dtype: str) -> ParamInfo:
    """A ParamInfo of a real tensor's shape, filled in directly (its __post_init__ checks dims a
    tensor always has; a rank may hold 10^5)."""
    info = _new(ParamInfo)
    _set(info, "name", name)
    _set(info, "global_shape", shape)
    _set(info, "dtype", dtype)
    return info


_new, _set = object.__new__, object.__setattr__


def _layout(regions: tuple[Region, ...]) -> tuple[int, tuple[int, ...], tuple[int, ...] | int] | None:
    """(ndim: 0 for a flat range, its coordinates in the columns, the local shape (a box) or numel
    (a range) its piece must have) of a piece's one region; None for several regions or a 0-D box,
    which the columns cannot hold."""
    region = regions[0] if len(regions) == 1 else None
    if isinstance(region, FlatRange):
        return 0, (region.start, region.stop), region.stop - region.start
    if isinstance(region, Box) and region.shape:
        return len(region.shape), (*region.offsets, *region.shape), region.shape
    return None


def _as_dtype(tensor: torch.Tensor, dtype: str) -> torch.Tensor:
    if str(tensor.dtype).removeprefix("torch.") == dtype:
        return tensor
    return tensor.to(getattr(torch, dtype))
