"""Megatron-style expert parameters: marked `allreduce=False`, named by their local index
(`...experts.local_experts.<i>...`), and sharded over the expert-parallel group.

Each rank holds `num_local` whole experts; its position `index` in its expert-parallel group says which:
local expert i is global expert `index * num_local + i` (Megatron's own numbering). Ranks at the same
position of different expert-parallel groups hold replicas of the same experts (the expert-data-parallel
group).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import UnsupportedParameter

if TYPE_CHECKING:
    import torch

EXPERT_GROUP_NAMES = ("ep", "expert_model_parallel", "expert_parallel")
"""groups= keys that name the expert-parallel group of Megatron-style expert parameters."""
EXPERT_DATA_PARALLEL_GROUP_NAMES = ("edp", "expert_data_parallel")
"""groups= keys that name the group over which experts are replicated (derived from the expert
groups when every expert-parallel group was given as a list of rank lists)."""

_LOCAL_EXPERT = re.compile(r"(?:^|\.)local_experts\.(\d+)(?=\.|$)")


def is_megatron_expert(param: torch.Tensor) -> bool:
    """Megatron marks expert parameters `allreduce = False` (its DDP reduces them over the expert-data-
    parallel group instead of the data-parallel one)."""
    return getattr(param, "allreduce", True) is False


@dataclass(frozen=True, kw_only=True)
class ExpertRank:
    """This rank's place among the experts: its position in its expert-parallel group, the group's size,
    how many experts each rank holds, and the name of the group experts are replicated over."""

    group: str
    """The `groups=` name of the expert-parallel group."""
    index: int
    """This rank's position in its expert-parallel rank list."""
    size: int
    """Ranks in that list."""
    num_local: int
    """Experts each rank holds (from the local expert indices in the parameter names)."""
    replica_group: str | None
    """The group the experts are replicated over; None when not replicated."""


def expert_rank(
    rank: int, groups: Mapping[str, tuple[tuple[int, ...], ...]], expert_names: Iterable[str]
) -> tuple[ExpertRank | None, dict[str, tuple[tuple[int, ...], ...]]]:
    """(this rank's ExpertRank or None when no expert-parallel group was given, groups to add to the
    topology: the expert-data-parallel group when it was derived)."""
    name = next((n for n in EXPERT_GROUP_NAMES if n in groups), None)
    if name is None:
        return None, {}
    mine = next((g for g in groups[name] if rank in g), None)
    if mine is None:
        raise UnsupportedParameter(
            f"groups[{name!r}] does not contain rank {rank}; pass the expert-parallel group this rank belongs to"
        )
    indices = {int(m.group(1)) for n in expert_names for m in [_LOCAL_EXPERT.search(n)] if m is not None}
    num_local = max(indices) + 1 if indices else 1
    added: dict[str, tuple[tuple[int, ...], ...]] = {}
    replica = next((n for n in EXPERT_DATA_PARALLEL_GROUP_NAMES if n in groups), None)
    lists = groups[name]
    if replica is None and len(lists) > 1 and len({len(g) for g in lists}) == 1:
        replica = "edp"
        added[replica] = tuple(tuple(sorted(g[i] for g in lists)) for i in range(len(mine)))
    experts = ExpertRank(
        group=name, index=mine.index(rank), size=len(mine), num_local=num_local, replica_group=replica
    )
    return experts, added


def global_expert_name(name: str, experts: ExpertRank | None) -> str:
    """`...local_experts.<i>...` renamed to the global expert number."""
    match = _LOCAL_EXPERT.search(name)
    if match is None:
        raise UnsupportedParameter(
            f"parameter {name!r} is marked allreduce=False (a Megatron expert) but its name has no "
            "local_experts.<i> to place it by; pass its pieces with ownership="
        )
    if experts is None:
        raise UnsupportedParameter(
            f"parameter {name!r} is a Megatron-style expert (allreduce=False) but no expert-parallel group was "
            "given; pass groups={'ep': <its expert-parallel group>} (a ProcessGroup or the list of rank lists)"
        )
    number = experts.index * experts.num_local + int(match.group(1))
    start, stop = match.span(1)
    return name[:start] + str(number) + name[stop:]
