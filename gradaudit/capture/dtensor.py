"""Ownership of DTensor parameters (FSDP2, HSDP, tensor parallel, FSDP2 over TP) from mesh and placements."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from ..model import Box
from .errors import UnsupportedParameter
from .ownership import LocalPiece
from .topology import TopologyBuilder, axis_names

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4 kept it under _tensor; such versions are not supported
        return False
    return isinstance(tensor, DTensor)


def dtensor_pieces(
    name: str, local_name: str | None, param: torch.Tensor, topology: TopologyBuilder
) -> list[LocalPiece]:
    """This rank's pieces of DTensor `param`: one Box per contiguous run of its local shard.

    A local shard is contiguous in every dimension for Shard and for the _StridedShard FSDP2 puts
    over tensor parallel; a non-contiguous one is still described exactly, as several pieces.
    """
    dtensor = cast("DTensor", param)
    mesh, placements = dtensor.device_mesh, tuple(dtensor.placements)
    if any(p.is_partial() for p in placements):
        raise UnsupportedParameter(
            f"parameter {name!r} is a DTensor with a Partial placement {placements}; its local values are "
            "not a slice of the parameter. Pass its pieces with ownership= to audit it"
        )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return []
    global_shape = tuple(int(s) for s in param.shape)
    # For each tensor dim, the global index runs [start, stop) this rank's local shard holds, in order.
    indices = _local_indices(global_shape, mesh, placements, coordinate)
    runs = [_runs_of(indices[d]) if d in indices else [(0, size)] for d, size in enumerate(global_shape)]
    if any(not r for r in runs):
        return []  # an empty local shard: this rank holds no element of the parameter
    replica_group = topology.replica_group_of(mesh, [i for i, p in enumerate(placements) if p.is_replicate()])
    local_shape = tuple(sum(stop - start for start, stop in dim_runs) for dim_runs in runs)
    dtype = str(param.dtype).removeprefix("torch.")
    pieces: list[LocalPiece] = []
    for combo in itertools.product(*(_with_local_starts(dim_runs) for dim_runs in runs)):
        offsets = tuple(start for (start, _stop), _local in combo)
        shape = tuple(stop - start for (start, stop), _local in combo)
        local_starts = tuple(local for _run, local in combo)
        select = _selector(local_starts, shape, local_shape)
        pieces.append(
            LocalPiece(
                param=name,
                global_shape=global_shape,
                dtype=dtype,
                regions=(Box(offsets=offsets, shape=shape),),
                local_shape=shape,
                grad=_grad_of(name, dtensor, placements, select),
                value=functools.partial(_local_value, dtensor, select),
                replica_group=replica_group,
                local_name=local_name,
                grad_partial=_partial_of(name, dtensor, placements) if replica_group else None,
            )
        )
    return pieces


def _local_value(param: DTensor, select: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return select(param.to_local().detach())


def _grad_of(
    name: str,
    param: DTensor,
    placements: tuple[Placement, ...],
    select: Callable[[torch.Tensor], torch.Tensor],
) -> Callable[[], torch.Tensor | None]:
    def grad() -> torch.Tensor | None:
        g = param.grad
        if g is None:
            return None
        if is_dtensor(g):
            partial_axes(name, tuple(g.placements), placements)  # refuses any other layout
            g = g.to_local()
        return select(g.detach())

    return grad


def _partial_of(name: str, param: DTensor, placements: tuple[Placement, ...]) -> Callable[[], str | None]:
    """The group the gradient of `param` is a pending sum over, as it is when called (None: not partial).

    Under sequence parallel, torch 2.13 leaves the gradient of a replicated LayerNorm weight as
    Partial(sum) over the tensor-parallel axis: each rank holds its sequence shard's contribution, and
    torch's clip_grad_norm_ and optimizers reduce it when they read it. Its mesh axes are groups of
    the topology already (TopologyBuilder.add_mesh records every axis)."""
    names = axis_names(param.device_mesh)

    def partial() -> str | None:
        g = param.grad
        if g is None or not is_dtensor(g):
            return None
        axes = partial_axes(name, tuple(g.placements), placements)
        if not axes:
            return None
        if len(axes) > 1:
            raise UnsupportedParameter(
                f"the gradient of {name!r} is a partial sum over several mesh axes {[names[a] for a in axes]}; "
                "gradaudit records partial sums over one axis (pass its pieces with ownership=)"
            )
        return names[axes[0]]

    return partial


def partial_axes(name: str, grad: tuple[Placement, ...], param: tuple[Placement, ...]) -> tuple[int, ...]:
    """The mesh axes along which a gradient laid out as `grad` is a pending sum for a parameter laid
    out as `param`; any other difference of layout is refused."""
    if grad == param:
        return ()
    axes = []
    for axis, (g, p) in enumerate(zip(grad, param, strict=True)):
        if g == p:
            continue
        if p.is_replicate() and g.is_partial() and getattr(g, "reduce_op", "sum") == "sum":
            axes.append(axis)
            continue
        raise UnsupportedParameter(
            f"the gradient of {name!r} has placements {grad}, its parameter {param}; gradaudit reads "
            "gradients laid out like their parameters, or pending sums (Partial('sum')) of replicated ones "
            "(call it after the gradient reduction, or pass the pieces with ownership=)"
        )
    return tuple(axes)


def _selector(
    local_starts: Sequence[int], shape: Sequence[int], local_shape: Sequence[int]
) -> Callable[[torch.Tensor], torch.Tensor]:
    whole = all(s == 0 for s in local_starts) and tuple(shape) == tuple(local_shape)

    def select(local: torch.Tensor) -> torch.Tensor:
        if tuple(local.shape) != tuple(local_shape):
            raise UnsupportedParameter(
                f"local tensor of shape {tuple(local.shape)} where the placements give {tuple(local_shape)} "
                "(a padded shard?); gradaudit needs the unpadded local shard"
            )
        if whole:
            return local
        for dim, (start, length) in enumerate(zip(local_starts, shape, strict=False)):
            local = local.narrow(dim, start, length)
        return local

    return select


def _with_local_starts(dim_runs: list[tuple[int, int]]) -> list[tuple[tuple[int, int], int]]:
    """Each run with where it starts in the local shard (the runs before it, end to end)."""
    local_starts = itertools.accumulate((stop - start for start, stop in dim_runs), initial=0)
    return list(zip(dim_runs, local_starts, strict=False))


def _local_indices(
    global_shape: tuple[int, ...],
    mesh: DeviceMesh,
    placements: tuple[Placement, ...],
    coordinate: Sequence[int],
) -> dict[int, list[int]]:
    """Global indices held along each sharded dim, computed the way DTensor itself does."""
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.tensor._utils import _get_shard_size_and_offsets
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return _contiguous_indices(global_shape, mesh, placements)
    shard_types = (Shard, _StridedShard)
    local_shape = list(global_shape)
    offsets: dict[int, Any] = {}  # a private API: an index tensor (or None) per sharded dim
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, shard_types):
            continue
        dim = placement.dim % len(global_shape)
        size, index = _get_shard_size_and_offsets(
            local_shape[dim],
            mesh.size(mesh_dim),
            coordinate[mesh_dim],
            placement,
            offsets.get(dim),
            global_shape[dim],
            False,
        )
        local_shape[dim] = size
        offsets[dim] = index
    return {
        dim: ([] if local_shape[dim] == 0 else [int(i) for i in index.tolist()])
        for dim, index in offsets.items()
    }


def _contiguous_indices(
    global_shape: tuple[int, ...], mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> dict[int, list[int]]:
    """Fallback through the public helper (first offset only), valid for contiguous local shards."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offsets = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    dims = {p.dim % len(global_shape) for p in placements if isinstance(p, Shard)}
    if any(type(p).__name__ == "_StridedShard" for p in placements):
        raise UnsupportedParameter(
            f"strided sharding {placements} needs torch >= 2.6 for gradaudit to map it"
        )
    return {d: list(range(offsets[d], offsets[d] + local_shape[d])) for d in dims}


def _runs_of(index: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
