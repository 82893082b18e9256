"""What the guard makes of a step its `spike=` rule calls a spike: each parameter's Σg² on this rank
(each copy once: the lowest holder's, as the true norm counts it), summed over the ranks in one
exchange, and this rank's stats dump of its real pieces, so that `gradaudit check` shows which
parameters hold most of Σg². The guard's dump of a step whose replicas differ (GA601) holds the same
pieces, so that `gradaudit check` of it names the parameters whose copies differ (`params_rank_dump`).

All of them come from the per-piece 2-norms the guard measured before the step's first clip call (no second
pass over the gradients): a piece's sum of squares is its norm squared, and its largest |g| is not
measured (the dump holds the norm, the largest any element can be; its note says so).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..model import ClipCall, ClipRecord, ParamInfo, Piece, TensorKind, TensorStats, Topology
from ..report.param_shares import SPIKE_TRIGGER

if TYPE_CHECKING:
    import torch

    from ..capture.ownership import LocalPiece
    from ..dumpfile.dump import ColumnarPieces, RankDump

SPIKE_API = "guard.spike"
"""The capture_api of a spike dump: its pieces are the parameters' (the guard's anomaly dumps hold
ownership groups)."""
PARAMS_API = "guard.params"
"""The capture_api of the guard's dump of a step whose replicas differ (GA601): its pieces are the
parameters', so that `gradaudit check` names the parameters whose copies differ."""
UNMEASURED_MAX = "(each piece's largest |g| is not measured: its norm stands for it)"


class SpikeSums:
    """Per parameter of the run (every rank's, in one order), this rank's part of its Σg²."""

    def __init__(self, pieces: Sequence[LocalPiece], names: Sequence[str], lowest: Sequence[bool]) -> None:
        self.names = tuple(names)
        position = {name: i for i, name in enumerate(self.names)}
        self._param = [position[piece.param] for piece in pieces]
        self._counted = [1.0 if low else 0.0 for low in lowest]
        """Per piece: 1 when this rank is its copy's lowest holder (each element counted once)."""

    def of(self, norms: tuple[torch.Tensor, tuple[int, ...]]) -> torch.Tensor:
        """This rank's part, a float64 host vector of one number per parameter of the run."""
        import torch

        values, present = norms
        index = torch.tensor([self._param[i] for i in present], dtype=torch.int64, device=values.device)
        counted = torch.tensor([self._counted[i] for i in present], dtype=torch.float64, device=values.device)
        squares = values.to(torch.float64).square() * counted
        out = torch.zeros(len(self.names), dtype=torch.float64, device=values.device)
        return out.index_add_(0, index, squares.nan_to_num(0.0, 0.0, 0.0)).cpu()


def spike_rank_dump(
    *,
    rank: int,
    world_size: int,
    step: int,
    pieces: Sequence[LocalPiece],
    norms: tuple[Any, tuple[int, ...]],
    topology: Topology,
    clip: tuple[float | None, float, float],
    note: str,
    run_id: str | None,
) -> RankDump:
    """This rank's stats dump of the spike step: its pieces with their gradients' sums of squares
    before the first clip call; `clip`: (reported norm, max_norm, norm_type) of the step's call."""
    from ..dumpfile.dump import RankDump

    infos, columns = param_pieces(pieces, norms)
    reported, max_norm, norm_type = clip
    call = ClipCall(reported_norm=reported, max_norm=max_norm, norm_type=norm_type)
    return RankDump(
        path="",
        rank=rank,
        world_size=world_size,
        step=step,
        mode="stats",
        run_id=run_id,
        params=infos,
        pieces=columns,
        topology=topology,
        clip=ClipRecord(max_norm=max_norm, norm_type=norm_type, reported_norm=reported, calls=(call,)),
        capture_api=SPIKE_API,
        trigger=SPIKE_TRIGGER,
        trigger_note=f"{note} {UNMEASURED_MAX}",
    )


def params_rank_dump(
    groups_dump: RankDump,
    pieces: Sequence[LocalPiece],
    norms: tuple[Any, tuple[int, ...]] | None,
    *,
    coef: float | None,
    grad_dtype: str | None,
) -> RankDump:
    """The guard's dump of a step whose replicas differ (GA601), with this rank's pieces of the
    parameters in place of its ownership groups (`groups_dump`, whose clip record, scaler and topology
    it keeps): each piece's sum of squares from its 2-norm before the step's first clip call, and its
    clipped gradient's from the coefficient the step applied. `norms` None: they are not known on
    this rank, and its pieces are kept without statistics."""
    infos, columns = param_pieces(pieces, norms, coef=coef, dtype=grad_dtype, every_piece=True)
    return dataclasses.replace(
        groups_dump,
        params=infos,
        pieces=columns,
        capture_api=PARAMS_API,
        trigger_note=f"each piece's statistics are its gradient's 2-norm before the step's first clip call "
        f"{UNMEASURED_MAX}",
    )


def param_pieces(
    pieces: Sequence[LocalPiece],
    norms: tuple[Any, tuple[int, ...]] | None,
    *,
    coef: float | None = None,
    dtype: str | None = None,
    every_piece: bool = False,
) -> tuple[tuple[ParamInfo, ...], ColumnarPieces]:
    """This rank's pieces (none empty) and their parameters, as a stats dump holds them: each piece's
    gradient statistics from its 2-norm in `norms` (the values, and the pieces they are of), and its
    clipped gradient's too given the finite coefficient `coef` the step applied; `dtype`: the
    gradients' where it is not the parameters'. A piece with no norm (no gradient) is left out, or
    with `every_piece` kept without statistics, as a capture keeps a piece with no gradient."""
    from ..dumpfile.dump import as_columns

    norm_of: dict[int, float] = {}
    if norms is not None:
        values, present = norms
        norm_of = dict(zip(present, values.double().cpu().tolist(), strict=True))
    clipped = coef is not None and math.isfinite(coef)
    found: list[Piece] = []
    params: dict[str, ParamInfo] = {}
    for i, piece in enumerate(pieces):
        norm = norm_of.get(i)
        numel = math.prod(piece.local_shape)
        if not numel or (norm is None and not every_piece):
            continue
        params.setdefault(
            piece.param,
            ParamInfo(name=piece.param, global_shape=tuple(piece.global_shape), dtype=piece.dtype),
        )
        stats: dict[TensorKind, TensorStats] = {}
        if norm is not None:
            stats["grad"] = _of_norm(norm, numel)
            if clipped:
                stats["grad_clipped"] = _of_norm(norm * abs(float(coef or 0.0)), numel)
        found.append(
            Piece(
                index=len(found),
                param=piece.param,
                regions=tuple(piece.regions),
                local_shape=tuple(piece.local_shape),
                dtype=dtype or piece.dtype,
                replica_group=piece.replica_group,
                stats=stats,
            )
        )
    infos = tuple(params.values())
    return infos, as_columns(infos, found)


def _of_norm(norm: float, numel: int) -> TensorStats:
    """A tensor's statistics from its 2-norm alone: its largest |x| is not measured, the norm (the
    largest it can be) stands for it (see UNMEASURED_MAX)."""
    square = norm * norm
    return TensorStats(numel=numel, norm_type=2.0, sum_pow=square, sum_sq=square, max_abs=norm)


def spike_params(every_rank: Sequence[Sequence[str]]) -> tuple[str, ...]:
    """The run's parameters in one order every rank computes alike."""
    return tuple(sorted({name for names in every_rank for name in names}))
