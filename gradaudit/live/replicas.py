"""Which rank's copy of a replicated ownership group differs from the copies the others hold, read bit
for bit from the gathered rows: the copies are each rank's own sum over bytes the stack's reduction
makes identical, so the rank whose sum stands apart from a majority that agrees is the one to suspect
(its device, or a code path only it ran), not the clipping code every rank shares. No torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .summary import HEADER, OK

if TYPE_CHECKING:
    import numpy as np

    from ..model import Topology
    from .analysis_input import OwnershipGroup


@dataclass(frozen=True, kw_only=True)
class ReplicaFault:
    """One copy of a replicated group whose bits differ from the others'."""

    group: str
    """The process group the copies are replicated over."""
    ranks: tuple[int, ...]
    """The ranks whose copy stands apart (all of the copy's holders when no majority agrees)."""
    agreeing: tuple[int, ...]
    """The ranks whose copies agree with each other (empty when no majority does)."""


def replica_faults(
    rows: np.ndarray,
    groups: Sequence[OwnershipGroup],
    held: Sequence[Sequence[bool]],
    topologies: Sequence[Topology],
    *,
    at: int = HEADER,
) -> tuple[ReplicaFault, ...]:
    """Per replicated group and copy, the ranks whose sum of it differs from its holders' majority:
    the rows' sums per group from `at` on (the gradients', or the weights': summary.VectorLayout)."""
    found = []
    measured = {rank for rank in range(rows.shape[0]) if rows[rank, 0] == OK}
    for i, group in enumerate(groups):
        if group.replica_group is None:
            continue
        seen: set[tuple[int, ...]] = set()
        for rank in sorted(measured):
            if not held[rank][i]:
                continue
            members = topologies[rank].group_of(group.replica_group, rank) or (rank,)
            holders = tuple(r for r in members if r in measured and held[r][i])
            if holders in seen or len(holders) < 2:
                continue
            seen.add(holders)
            bits = {r: rows[r, at + i].tobytes() for r in holders}
            (common, times), *rest = Counter(bits.values()).most_common()
            if not rest:
                continue
            if times * 2 > len(holders):
                odd = tuple(r for r in holders if bits[r] != common)
                agreeing = tuple(r for r in holders if bits[r] == common)
            else:
                odd, agreeing = holders, ()
            found.append(ReplicaFault(group=group.replica_group, ranks=odd, agreeing=agreeing))
    return tuple(found)
