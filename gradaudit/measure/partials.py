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

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import StepFolderError
from ..model import Piece, StepDump, TensorKind, TensorStats

if TYPE_CHECKING:
    import numpy as np

    from ..dumpfile.reader import TensorReader
    from .measurements import PieceMeasurement

Entry = tuple[int, str, Piece]
"""(rank, file path, piece) as measure.pieces_by_param gives them."""

SUMMED_KINDS: tuple[TensorKind, ...] = ("grad", "grad_clipped")


def split_partial(held: Sequence[Entry]) -> tuple[list[Entry], list[Entry]]:
    """(pieces holding values of their own, pending partial sums)."""
    whole: list[Entry] = []
    partial: list[Entry] = []
    for entry in held:
        (partial if entry[2].partial_group is not None else whole).append(entry)
    return whole, partial


def measure_partial_sums(
    step: StepDump,
    partial: Sequence[Entry],
    norm_type: float,
    *,
    measure_one: Callable[[Entry], PieceMeasurement],
    reader: TensorReader,
    scale_of: Callable[[int], float],
) -> list[PieceMeasurement]:
    """One measurement per (layout, rank list of the partial group): the base (lowest-rank) piece's
    own measurement (its parameters, its update) with the gradient numbers of the group's sum."""
    sums: dict[tuple[object, tuple[int, ...]], list[Entry]] = {}
    for rank, path, piece in partial:
        group = piece.partial_group
        assert group is not None  # split_partial sorted it here
        group_ranks = step.ranks[rank].topology.group_of(group, rank)
        if group_ranks is None or rank not in group_ranks:
            raise StepFolderError(
                f"{path}: piece {piece.index} of {piece.param!r} is a partial sum over group {group!r}, which "
                "the file's topology does not list for this rank; rewrite the dump naming a group of its topology"
            )
        sums.setdefault((piece.layout_key, group_ranks), []).append((rank, path, piece))
    measured = []
    present = set(step.ranks_present)
    for key in sorted(sums, key=lambda k: min((r, p.index) for r, _, p in sums[k])):
        group_ranks = key[1]
        if not present.issuperset(group_ranks):
            continue  # a missing rank's share of the sum: its elements are unknown, like the rank's own
        members = sorted(sums[key], key=lambda e: (e[0], e[2].index))
        if [rank for rank, _, _ in members] != list(group_ranks) or any(
            "grad" not in piece.tensors for _, _, piece in members
        ):
            path, piece = members[0][1], members[0][2]
            raise StepFolderError(
                f"{path}: {piece.param!r} is a partial sum over ranks {list(group_ranks)}, but its pieces with "
                f"gradient values are on ranks {[r for r, _, p in members if 'grad' in p.tensors]}; a partial sum "
                "needs every member's values (dump them in full, or with full_params=)"
            )
        base = measure_one(members[0])
        measured.append(_with_sum(base, members, norm_type, reader, scale_of))
    return measured


def _with_sum(
    base: PieceMeasurement,
    members: Sequence[Entry],
    norm_type: float,
    reader: TensorReader,
    scale_of: Callable[[int], float],
) -> PieceMeasurement:
    import numpy as np

    from .kernel import stats_of_array

    totals: dict[TensorKind, np.ndarray] = {}
    for kind in SUMMED_KINDS:
        if not all(kind in piece.tensors for _, _, piece in members):
            continue
        total = np.zeros(members[0][2].numel, dtype=np.float64)
        with np.errstate(all="ignore"):
            for rank, path, piece in members:
                values = reader.float64(path, piece.tensors[kind], 0, piece.numel)
                scale = scale_of(rank)
                total += values / scale if scale != 1.0 else values
        totals[kind] = total
    stats: dict[TensorKind, TensorStats] = dict(base.stats)
    for kind in SUMMED_KINDS:
        if kind in totals:
            stats[kind] = stats_of_array(totals[kind], "float64", norm_type)
        else:
            stats.pop(kind, None)  # one member's part alone is no part of any norm
    dot_pre_post = dot_pre_pre = None
    if "grad" in totals and "grad_clipped" in totals:
        a, b = totals["grad"], totals["grad_clipped"]
        both = np.isfinite(a) & np.isfinite(b)
        dot_pre_post, dot_pre_pre = float(np.dot(a[both], b[both])), float(np.dot(a[both], a[both]))
    return replace(
        base,
        stats=dict(sorted(stats.items())),
        dot_pre_post=dot_pre_post,
        dot_pre_pre=dot_pre_pre,
        value_scale=1.0,
    )
