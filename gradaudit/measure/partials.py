"""Pending partial sums: pieces whose gradient is summed over a group (sequence parallel), measured as
the sum they stand for.

Under torch's SequenceParallel the gradient of a replicated LayerNorm weight is a DTensor
`Partial("sum")`: each rank of the tensor-parallel group holds its sequence shard's contribution,
and torch's clip_grad_norm_ (and the optimizer) all-reduce it when they read it. The dump keeps
each rank's partial values (`Piece.partial_group`); the true gradient of the elements is their sum,
so the norm terms come from the sum, taken here in float64, and stand for the group once: they are
put on its lowest rank, like a replica set's base copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..dumpfile.dump import StepDump
from ..errors import StepFolderError
from ..model import Piece, TensorKind, TensorStats

if TYPE_CHECKING:
    import numpy as np

    from ..dumpfile.reader import TensorReader
    from .table import PieceTable

Member = tuple[int, str, Piece, int]
"""(rank, file path, piece, its position in the file) of one member of a partial sum."""

SUMMED_KINDS: tuple[TensorKind, ...] = ("grad", "grad_clipped")


def partial_sums(step: StepDump) -> tuple[dict[str, list[list[Member]]], dict[int, list[int]]]:
    """(parameter -> the members of each of its partial sums, one per (layout, rank list of the
    group), the base (lowest-rank) member first; rank -> the file positions the step's table
    leaves out: every member but a base, and every member of a sum with a rank missing (its
    share of the sum is unknown, like the rank's own elements))."""
    sums: dict[tuple[object, tuple[int, ...]], list[Member]] = {}
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        at = sorted(dump.pieces.extras.partial_groups)
        if not at:
            continue
        for local, piece in zip(at, dump.pieces.build(at), strict=True):
            group = piece.partial_group
            assert group is not None  # listed in partial_groups
            group_ranks = dump.topology.group_of(group, rank)
            if group_ranks is None or rank not in group_ranks:
                raise StepFolderError(
                    f"{dump.path}: piece {piece.index} of {piece.param!r} is a partial sum over group {group!r}, "
                    "which the file's topology does not list for this rank; rewrite the dump naming a group of its "
                    "topology"
                )
            sums.setdefault((piece.layout_key, group_ranks), []).append((rank, dump.path, piece, local))
    found: dict[str, list[list[Member]]] = {}
    dropped: dict[int, list[int]] = {}
    present = set(step.ranks_present)
    for (_, group_ranks), entries in sums.items():
        members = sorted(entries, key=lambda e: (e[0], e[2].index))
        if not present.issuperset(group_ranks):
            for rank, _, _, local in members:
                dropped.setdefault(rank, []).append(local)
            continue
        if [rank for rank, _, _, _ in members] != list(group_ranks) or any(
            "grad" not in piece.tensors for _, _, piece, _ in members
        ):
            path, piece = members[0][1], members[0][2]
            raise StepFolderError(
                f"{path}: {piece.param!r} is a partial sum over ranks {list(group_ranks)}, but its pieces with "
                f"gradient values are on ranks {[r for r, _, p, _ in members if 'grad' in p.tensors]}; a partial sum "
                "needs every member's values (dump them in full, or with full_params=)"
            )
        found.setdefault(members[0][2].param, []).append(members)
        for rank, _, _, local in members[1:]:
            dropped.setdefault(rank, []).append(local)
    return found, dropped


def record_sum(table: PieceTable, members: Sequence[Member], reader: TensorReader) -> None:
    """The base member's measurement (its parameters, its update, already read) with the gradient
    numbers of the group's sum, taken in float64: what the table holds at the base's position."""
    import numpy as np

    from .kernel import stats_of_array
    from .measurements import piece_flat

    totals: dict[TensorKind, np.ndarray] = {}
    for kind in SUMMED_KINDS:
        if not all(kind in piece.tensors for _, _, piece, _ in members):
            continue
        total = np.zeros(members[0][2].numel, dtype=np.float64)
        with np.errstate(all="ignore"):
            for rank, path, piece, _ in members:
                total += piece_flat(reader, path, piece, kind, 0, piece.numel, table.scale_of(rank))
        totals[kind] = total
    stats: dict[TensorKind, TensorStats] = {
        kind: stats_of_array(total, "float64", table.read_norm_type) for kind, total in totals.items()
    }
    dot_pre_post = dot_pre_pre = None
    if "grad" in totals and "grad_clipped" in totals:
        a, b = totals["grad"], totals["grad_clipped"]
        both = np.isfinite(a) & np.isfinite(b)
        dot_pre_post, dot_pre_pre = float(np.dot(a[both], b[both])), float(np.dot(a[both], a[both]))
    rank, _, _, local = members[0]
    position = table.find(rank, local)
    update = float(table.products[position, 2]) if table.has_products[position, 2] else None
    table.record(
        position,
        stats,
        (dot_pre_post, dot_pre_pre, update),
        removed=[kind for kind in SUMMED_KINDS if kind not in totals],  # one member's part is in no norm
        scale=1.0,
    )
