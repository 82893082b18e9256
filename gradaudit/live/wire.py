"""What the ranks' guards tell each other of their ownership when attaching (and when the parameters
change), as JSON: each piece's parameter, regions, ownership group and dtype, the rank's topology, and
how many earlier attempts wrote dumps into its out_dir, and where it runs (host, device: what a
rank-local fault is named by). No torch."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from ..model import FlatRange, MeshInfo, Region, Topology

PieceKey = tuple[str, "tuple[Region, ...] | None", str, str]
"""(parameter, its regions on this rank or None for an empty piece, ownership group, dtype)."""
ToldPiece = tuple[str, "tuple[tuple[Any, ...], ...] | None", str, str]
"""A PieceKey as another rank told it: its regions as plain tuples, ("flat", start, stop) or ("box",
offsets, shape), equal when the regions are (compared, never used as regions: no Box is built for
each of a large model's pieces)."""


class Told(NamedTuple):
    """What one rank told the others when attaching."""

    pieces: list[ToldPiece]
    topology: Topology
    attempts: int
    host: str
    device: str


def encode(pieces: list[PieceKey], topology: Topology, attempts: int, *, host: str, device: str) -> bytes:
    mesh = topology.mesh
    document = {
        "host": host,
        "device": device,
        "pieces": [[param, _regions(regions), key, dtype] for param, regions, key, dtype in pieces],
        "groups": {name: [list(ranks) for ranks in lists] for name, lists in topology.groups.items()},
        "mesh": None if mesh is None else [list(mesh.shape), list(mesh.axis_names), list(mesh.ranks)],
        "norm_group": topology.norm_group,
        "attempts": attempts,
    }
    return json.dumps(document, separators=(",", ":")).encode()


def decode(data: bytes) -> Told:
    document = json.loads(data)
    pieces: list[ToldPiece] = [
        (param, None if regions is None else tuple(map(_told, regions)), key, dtype)
        for param, regions, key, dtype in document["pieces"]
    ]
    mesh = document["mesh"]
    topology = Topology(
        groups={name: tuple(tuple(ranks) for ranks in lists) for name, lists in document["groups"].items()},
        mesh=None
        if mesh is None
        else MeshInfo(shape=tuple(mesh[0]), axis_names=tuple(mesh[1]), ranks=tuple(mesh[2])),
        norm_group=document["norm_group"],
    )
    return Told(pieces, topology, int(document["attempts"]), str(document["host"]), str(document["device"]))


def _regions(regions: tuple[Region, ...] | None) -> list[Any] | None:
    if regions is None:
        return None
    return [
        ["flat", r.start, r.stop] if isinstance(r, FlatRange) else ["box", list(r.offsets), list(r.shape)]
        for r in regions
    ]


def _told(raw: list[Any]) -> tuple[Any, ...]:
    return tuple(tuple(part) if isinstance(part, list) else part for part in raw)
