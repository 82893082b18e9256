"""What this rank can see of the process groups: mesh axes, DDP and user groups, replica groups."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..model import MeshInfo, Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

WORLD = "world"
PIPELINE_AXIS_NAMES = frozenset({"pp", "pipeline", "pipeline_parallel", "pipeline_model_parallel"})
"""Mesh axes along which ranks hold different stages: a parameter is never replicated over them
(a weight tied across stages is declared with aliases= instead)."""


def root_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh `mesh` was sliced from (itself when it was not), across torch versions."""
    getter = getattr(mesh, "_get_root_mesh", None)
    if getter is not None:
        root = getter()
        return root if root is not None else mesh
    try:  # torch < 2.9 kept the slicing bookkeeping in a module-level registry
        from torch.distributed.device_mesh import _mesh_resources

        return _mesh_resources.get_root_mesh(mesh)
    except (ImportError, AttributeError):
        return mesh


def axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    if names:
        return tuple(names)
    return tuple(f"mesh_dim{i}" for i in range(mesh.ndim))


def rank_lists_over_axes(
    ranks: Sequence[int], shape: Sequence[int], axes: Iterable[int]
) -> tuple[tuple[int, ...], ...]:
    """The groups of ranks (row-major `ranks` of a mesh of `shape`) that differ only along `axes`."""
    axes = sorted(set(axes))
    others = [a for a in range(len(shape)) if a not in axes]
    group_size = math.prod(shape[a] for a in axes)
    groups: dict[tuple[int, ...], list[int]] = {}
    strides = [math.prod(shape[a + 1 :]) for a in range(len(shape))]
    for flat_index, rank in enumerate(ranks):
        coord = [(flat_index // strides[a]) % shape[a] for a in range(len(shape))]
        groups.setdefault(tuple(coord[a] for a in others), []).append(rank)
    lists = tuple(sorted(tuple(sorted(g)) for g in groups.values()))
    assert all(len(g) == group_size for g in lists)
    return lists


class TopologyBuilder:
    """Collects every group this rank can name without a collective; `build()` gives the Topology."""

    def __init__(self, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self._groups: dict[str, set[tuple[int, ...]]] = {}
        self._meshes: dict[tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]], MeshInfo] = {}
        if world_size > 1:
            self.add_group(WORLD, [tuple(range(world_size))])

    def add_group(self, name: str, rank_lists: Iterable[Sequence[int]]) -> None:
        self._groups.setdefault(name, set()).update(tuple(sorted(set(g))) for g in rank_lists)

    def my_ranks(self, name: str) -> tuple[int, ...] | None:
        """This rank's rank list in group `name`, when known."""
        for ranks in self._groups.get(name, ()):
            if self.rank in ranks:
                return ranks
        return None

    def name_of(self, ranks: Sequence[int], default: str) -> str:
        """An existing group name whose list for this rank is exactly `ranks`, else `default` (added)."""
        ranks = tuple(sorted(set(ranks)))
        for name in sorted(self._groups, key=lambda n: (n == WORLD, n)):
            if self.my_ranks(name) == ranks:
                return name
        self.add_group(default, [ranks])
        return default

    def add_mesh(self, mesh: DeviceMesh) -> MeshInfo:
        """Record a root mesh: its shape, axis names and the rank lists of each axis."""
        names = axis_names(mesh)
        info = MeshInfo(
            shape=tuple(int(s) for s in mesh.mesh.shape),
            axis_names=names,
            ranks=tuple(int(r) for r in mesh.mesh.reshape(-1).tolist()),
        )
        if info not in self._meshes.values():
            self._meshes[(info.shape, info.axis_names, info.ranks)] = info
            for axis, name in enumerate(names):
                self.add_group(name, rank_lists_over_axes(info.ranks, info.shape, [axis]))
        return info

    def replica_group_of(self, mesh: DeviceMesh, replicated_axes: Sequence[int]) -> str | None:
        """Name (and record) the group over which a DTensor on `mesh` is replicated.

        The replicated axes are those of `mesh` with a Replicate placement plus the axes of its root
        mesh that `mesh` does not span (a parameter on the dp slice of a (dp, tp) mesh is the same on
        every tp rank), except pipeline axes. The name joins the axis names with '+', e.g.
        'dp_replicate' or 'dp+tp'.
        """
        root = root_mesh(mesh)
        sub_names = axis_names(mesh)
        root_names = axis_names(root)
        if root is not mesh and not set(sub_names) <= set(root_names):
            root, root_names = mesh, sub_names  # a flattened slice: only its own axes are known
        info = self.add_mesh(root)
        axes = {root_names.index(sub_names[i]) for i in replicated_axes}
        axes |= {a for a, n in enumerate(root_names) if n not in sub_names and n not in PIPELINE_AXIS_NAMES}
        if not axes:
            return None
        name = "+".join(root_names[a] for a in sorted(axes))
        self.add_group(name, rank_lists_over_axes(info.ranks, info.shape, axes))
        return name

    def largest_mesh_group(self) -> str | None:
        """The group spanning all axes of the largest root mesh seen (plain params beside DTensors)."""
        mesh = self.mesh()
        if mesh is None:
            return None
        name = "+".join(mesh.axis_names)
        self.add_group(name, [tuple(sorted(mesh.ranks))])
        return name

    def mesh(self) -> MeshInfo | None:
        if not self._meshes:
            return None
        return max(self._meshes.values(), key=lambda m: (len(m.ranks), len(m.shape)))

    def build(self) -> Topology:
        groups = {name: tuple(sorted(lists)) for name, lists in sorted(self._groups.items())}
        return Topology(groups=groups, mesh=self.mesh())


def normalize_groups(
    groups: Mapping[str, object] | None, *, world_size: int
) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The user's `groups=` as rank lists: a ProcessGroup becomes this rank's list of global ranks."""
    from ..errors import CaptureError

    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for name, value in (groups or {}).items():
        if not isinstance(name, str) or not name:
            raise CaptureError(f"groups= keys must be non-empty group names (str), got {name!r}")
        lists = _rank_lists(value)
        if lists is None:
            raise CaptureError(
                f"groups[{name!r}] is {type(value).__name__}; pass a torch.distributed ProcessGroup, "
                "a list of ranks, or a list of rank lists"
            )
        for ranks in lists:
            if any(r < 0 or r >= world_size for r in ranks):
                raise CaptureError(
                    f"groups[{name!r}] names rank(s) outside world size {world_size}: {list(ranks)}"
                )
        out[name] = lists
    return out


def _rank_lists(value: object) -> tuple[tuple[int, ...], ...] | None:
    if isinstance(value, (list, tuple)):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return (tuple(value),) if value else ()
        if all(isinstance(v, (list, tuple)) and all(isinstance(r, int) for r in v) for v in value):
            return tuple(tuple(v) for v in value)
        return None
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed support
        return None
    if value is dist.GroupMember.NON_GROUP_MEMBER:  # new_group() on a rank outside the group
        return ()
    if isinstance(value, dist.ProcessGroup):
        return (tuple(dist.get_process_group_ranks(value)),)
    return None


def with_norm_group(topology: Topology, ranks: Sequence[int], *, rank: int, default: str) -> Topology:
    """`topology` with its norm_group set to the group whose list for `rank` is `ranks`.

    An existing group with that list is named (a mesh axis before 'world'); otherwise the group is
    added under `default`.
    """
    import dataclasses

    ranks = tuple(sorted(set(ranks)))
    for name in sorted(topology.groups, key=lambda n: (n == WORLD, n)):
        if topology.group_of(name, rank) == ranks:
            return dataclasses.replace(topology, norm_group=name)
    groups = dict(topology.groups)
    groups[default] = tuple(sorted(set(groups.get(default, ())) | {ranks}))
    return dataclasses.replace(topology, groups=groups, norm_group=default)
