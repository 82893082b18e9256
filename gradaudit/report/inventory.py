"""`gradaudit show`: what a step folder holds, as plain values (pure: no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..model import Box, FlatRange, Mode, Piece, Region, StepFacts
from .model import GuardTrend


@dataclass(frozen=True, kw_only=True)
class ParamHolding:
    name: str
    """The logical parameter."""
    global_shape: tuple[int, ...]
    """Shape of the whole parameter."""
    dtype: str
    """Its dtype name."""
    layout: str
    """"replicated", "sharded" or "sharded+replicated", with the replica group when named."""
    holders: tuple[tuple[int, str], ...]
    """(rank, what that rank holds) for every piece, by rank."""


@dataclass(frozen=True, kw_only=True)
class LeftOut:
    """A parameter some ranks did not capture (GA104), with why."""

    name: str
    """The logical parameter."""
    reason: str
    """Why the ranks left it out."""
    ranks: tuple[int, ...]
    """The ranks that left it out for that reason, ascending."""


@dataclass(frozen=True, kw_only=True)
class Inventory:
    directory: str
    """The step folder."""
    step: int
    """The optimizer step."""
    world_size: int
    """Ranks of the run."""
    ranks_present: tuple[int, ...]
    """Ranks with a readable file, ascending."""
    missing_ranks: tuple[int, ...]
    """Ranks of the world size without a readable file."""
    modes: tuple[Mode, ...]
    """The rank files' capture modes, sorted."""
    groups: tuple[tuple[str, str], ...]
    """(group name, its rank lists as text), by name."""
    mesh: str | None
    """The device mesh as "axis=size x ..."; None without one."""
    norm_group: str | None
    """The group the clip call reduced its norm over; None when unknown."""
    params: tuple[ParamHolding, ...]
    """Every logical parameter with who holds what, by name."""
    bytes_by_rank: tuple[tuple[int, int], ...]
    """(rank, size of its file in bytes), by rank."""
    warnings: tuple[str, ...] = ()
    """What the loader skipped."""
    not_captured: tuple[LeftOut, ...] = ()
    """Parameters left out of the dump, one entry per (name, reason), sorted by name."""

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.bytes_by_rank)


@dataclass(frozen=True, kw_only=True)
class RunInventory:
    """What a run folder holds: each step folder's inventory, and a guarded run's trend."""

    directory: str
    """The run folder."""
    steps: tuple[Inventory, ...]
    """One inventory per step folder, by step number (the guard's full captures among them)."""
    guard_trend: GuardTrend | None = None
    """The guard's trend when the folder is a guarded run's; else None."""


def _region_text(region: Region) -> str:
    if isinstance(region, Box):
        return (
            "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(region.offsets, region.shape, strict=False)) + "]"
        )
    assert isinstance(region, FlatRange)
    return f"flat[{region.start}:{region.stop}]"


def build_inventory(step: StepFacts, pieces: Mapping[int, Sequence[Piece]]) -> Inventory:
    """What the step's files hold: `step`'s facts, and each present rank's pieces."""
    pieces_by_param: dict[str, list[tuple[int, Piece]]] = {}
    for rank in step.ranks_present:
        for piece in pieces[rank]:
            pieces_by_param.setdefault(piece.param, []).append((rank, piece))
    params = []
    for name, info in step.params.items():
        held = pieces_by_param.get(name, [])
        layouts = {p.layout_key for _, p in held}
        copies = len(held) / max(len(layouts), 1)
        if len(layouts) <= 1 and len(held) > 1:
            layout = "replicated"
        elif copies > 1:
            layout = "sharded+replicated"
        else:
            layout = "sharded" if len(held) > 1 else ("whole" if held else "absent")
        groups = sorted({p.replica_group for _, p in held if p.replica_group})
        if groups and "replicated" in layout:
            layout += f" over {', '.join(groups)}"
        holders = tuple(
            (
                rank,
                " ".join(_region_text(r) for r in piece.regions)
                + (f" as {piece.local_name}" if piece.local_name else ""),
            )
            for rank, piece in held
        )
        params.append(
            ParamHolding(
                name=name, global_shape=info.global_shape, dtype=info.dtype, layout=layout, holders=holders
            )
        )
    topo = step.topology
    mesh = None
    if topo.mesh is not None:
        mesh = " x ".join(f"{n}={s}" for n, s in zip(topo.mesh.axis_names, topo.mesh.shape, strict=False))
    return Inventory(
        directory=step.directory,
        step=step.step,
        world_size=step.world_size,
        ranks_present=step.ranks_present,
        missing_ranks=step.missing_ranks,
        modes=tuple(sorted({d.mode for d in step.ranks.values()})),
        groups=tuple(
            (name, " ".join(str(list(g)) for g in lists)) for name, lists in sorted(topo.groups.items())
        ),
        mesh=mesh,
        norm_group=topo.norm_group,
        params=tuple(params),
        bytes_by_rank=tuple((r, step.ranks[r].num_bytes) for r in step.ranks_present),
        warnings=step.warnings,
        not_captured=_left_out(step),
    )


def _left_out(step: StepFacts) -> tuple[LeftOut, ...]:
    ranks_of: dict[tuple[str, str], list[int]] = {}
    for rank in step.ranks_present:
        for param in step.ranks[rank].not_captured:
            ranks_of.setdefault((param.name, param.reason), []).append(rank)
    return tuple(
        LeftOut(name=name, reason=reason, ranks=tuple(ranks))
        for (name, reason), ranks in sorted(ranks_of.items())
    )


def inventory_to_json(inv: Inventory) -> dict[str, Any]:
    return {
        "directory": inv.directory,
        "step": inv.step,
        "world_size": inv.world_size,
        "ranks_present": list(inv.ranks_present),
        "missing_ranks": list(inv.missing_ranks),
        "modes": list(inv.modes),
        "topology": {"groups": dict(inv.groups), "mesh": inv.mesh, "norm_group": inv.norm_group},
        "params": [
            {
                "name": p.name,
                "global_shape": list(p.global_shape),
                "dtype": p.dtype,
                "layout": p.layout,
                "holders": [{"rank": r, "holds": h} for r, h in p.holders],
            }
            for p in inv.params
        ],
        "bytes": {"total": inv.total_bytes, "by_rank": {str(r): n for r, n in inv.bytes_by_rank}},
        "warnings": list(inv.warnings),
        "not_captured": [
            {"name": p.name, "reason": p.reason, "ranks": list(p.ranks)} for p in inv.not_captured
        ],
    }
