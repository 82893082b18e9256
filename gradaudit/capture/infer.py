"""Which stack holds each parameter, and the pieces and topology this rank writes (the dispatcher)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import CaptureError
from ..model import FLOAT_DTYPES, Topology
from ..warn import warn_once
from .dtensor import dtensor_pieces, is_dtensor
from .errors import UnsupportedParameter
from .experts import ExpertRank, expert_rank, global_expert_name, is_megatron_expert
from .fsdp1 import fsdp1_groups, fsdp1_pieces
from .names import is_ddp, logical_parameter_columns
from .ownership import LocalPiece
from .plain import (
    LocalPieces,
    TensorParallelRank,
    dtype_name,
    is_megatron_sharded,
    plain_pieces,
    whole_pieces,
    whole_rows,
)
from .snapshots import collection_paused
from .topology import WORLD, TopologyBuilder

TENSOR_PARALLEL_GROUP_NAMES = ("tp", "tensor_model_parallel", "tensor_parallel")
"""groups= keys that name the tensor-parallel group of Megatron-style (attribute-marked) parameters."""
_MARKS = frozenset({"tensor_model_parallel", "allreduce", "shared"})
"""The attributes Megatron marks its sharded, expert and tied parameters with."""
DATA_PARALLEL_GROUP_NAME = "dp"
"""groups= key naming the group over which plain parameters are replicated (when no DDP wrapper says)."""


@dataclass(frozen=True, kw_only=True)
class Ownership:
    pieces: LocalPieces
    """This rank's pieces, one per local part of a logical parameter, as columns."""
    topology: Topology
    """The process groups and mesh the pieces name."""
    aliases: Mapping[str, str]
    """This rank's parameter name -> logical name, for the names that differ."""


@collection_paused()
def infer_ownership(
    model: torch.nn.Module,
    *,
    rank: int,
    world_size: int,
    groups: Mapping[str, tuple[tuple[int, ...], ...]],
    aliases: Mapping[str, str],
    explicit: Sequence[LocalPiece] = (),
    on_unsupported: Callable[[str, Exception], None],
) -> Ownership:
    """Every local piece of `model` on this rank, with the topology they refer to.

    A parameter that cannot be described is reported to `on_unsupported` and left out.
    """
    topology = TopologyBuilder(rank=rank, world_size=world_size)
    for name, lists in groups.items():
        topology.add_group(name, lists)
    logicals, fqns, tensors = logical_parameter_columns(model)
    alias_of: dict[str, str] = {}
    if aliases:
        _check_aliases(aliases, {*logicals, *fqns})
        pairs = zip(logicals, fqns, strict=True)
        alias_of = {**{logical: aliases[fqn] for logical, fqn in pairs if fqn in aliases}, **aliases}

    explicit_names = frozenset(p.local_name or p.param for p in explicit)
    fsdp1 = _fsdp1_pieces(model, topology, explicit_names)
    if fsdp1 is not None:
        flat = LocalPieces.of([_aliased(p, alias_of) for p in fsdp1])
        held = LocalPieces.joined([flat, LocalPieces.of(explicit)])
        return Ownership(pieces=held, topology=topology.build(), aliases=_local_aliases(flat))

    pieces: list[LocalPiece] = []
    plain_types = {torch.Tensor, torch.nn.Parameter}
    if not explicit_names and set(map(type, tensors)) <= plain_types:  # no DTensor: all plain
        kept: list[bool] = list(map(operator.attrgetter("requires_grad"), tensors))
    else:  # a DTensor's pieces are made here; the plain parameters kept for below
        kept = []
        for logical, fqn, param in zip(logicals, fqns, tensors, strict=True):
            wanted = param.requires_grad and logical not in explicit_names and fqn not in explicit_names
            dtensor = wanted and type(param) not in plain_types and is_dtensor(param)
            if dtensor:
                make = functools.partial(dtensor_pieces, *_names(logical, alias_of), param, topology)
                _extend(pieces, on_unsupported, logical, make)
            kept.append(wanted and not dtensor)
    if not all(kept):
        logicals = list(itertools.compress(logicals, kept))
        tensors = list(itertools.compress(tensors, kept))

    whole = None
    if tensors:
        whole = _whole_replicas(model, logicals, tensors, topology, world_size, groups, alias_of)
        if whole is None:
            plain = list(zip(logicals, tensors, strict=True))
            pieces.extend(_plain_pieces(model, plain, topology, world_size, groups, alias_of, on_unsupported))
    parts = [LocalPieces.of(pieces), *([whole] if whole is not None else []), LocalPieces.of(explicit)]
    held = LocalPieces.joined(parts)
    return Ownership(pieces=held, topology=topology.build(), aliases=_local_aliases(held))


def _whole_replicas(
    model: torch.nn.Module,
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    topology: TopologyBuilder,
    world_size: int,
    groups: Mapping[str, tuple[tuple[int, ...], ...]],
    alias_of: Mapping[str, str],
) -> LocalPieces | None:
    """The plain parameters `tensors` as whole rows when every one is a torch.Tensor or Parameter of
    a float dtype, without Megatron's marks or an alias, so a whole replica; else None, and they are
    LocalPiece objects first (the order of the pieces is the same either way)."""
    if not set(map(type, tensors)) <= {torch.Tensor, torch.nn.Parameter}:
        return None
    if any(map(vars, tensors)) and any(not _MARKS.isdisjoint(vars(t)) for t in tensors):
        return None
    if alias_of and any(_names(logical, alias_of)[1] is not None for logical in names):
        return None
    rows = whole_rows(names, tensors)
    if any(dtype_name(dtype) not in FLOAT_DTYPES for _, dtype, _ in rows.kinds):
        return None
    if any(0 in shape for shape, _, _ in rows.kinds):
        kept = [i for i, t in enumerate(tensors) if t.numel()]
        if not kept:
            return None
        rows = whole_rows([names[i] for i in kept], [tensors[i] for i in kept])
    _, _, group = _plain_groups(model, topology, world_size, groups)
    return LocalPieces.of_whole(rows, group)


def _plain_pieces(
    model: torch.nn.Module,
    plain: Sequence[tuple[str, torch.Tensor]],
    topology: TopologyBuilder,
    world_size: int,
    groups: Mapping[str, tuple[tuple[int, ...], ...]],
    alias_of: Mapping[str, str],
    on_unsupported: Callable[[str, Exception], None],
) -> list[LocalPiece]:
    """Pieces of the plain-tensor parameters: replicas over the data-parallel (or mesh, or world)
    group, or Megatron tensor-parallel partitions replicated over the data-parallel group."""
    dp_group, tensor_parallel, replicated_group = _plain_groups(model, topology, world_size, groups)
    pieces: list[LocalPiece] = []
    # A tensor without instance attributes carries no Megatron mark (expert, shared, partitioned):
    # it is one whole replica, taken without the checks below (10^5 parameters a rank happen).
    marked = [bool(vars(param)) for _, param in plain]
    expert_names = [
        logical
        for (logical, param), mark in zip(plain, marked, strict=True)
        if mark and is_megatron_expert(param)
    ]
    experts, expert_problem = None, None
    if expert_names:
        try:
            experts, expert_groups = expert_rank(topology.rank, groups, expert_names)
        except UnsupportedParameter as exc:
            expert_problem = exc
        else:
            for name, lists in expert_groups.items():
                topology.add_group(name, lists)
    for (logical, param), mark in zip(plain, marked, strict=True):
        if not mark:
            try:
                pieces += whole_pieces(*_names(logical, alias_of), param, replicated_group)
            except Exception as exc:  # noqa: BLE001  as in _extend
                on_unsupported(logical, exc)
            continue
        if is_megatron_expert(param):
            make = functools.partial(
                megatron_expert_pieces, logical, param, experts, alias_of, tensor_parallel, expert_problem
            )
            _extend(pieces, on_unsupported, logical, make)
            continue
        if getattr(param, "shared", False) and logical not in alias_of:
            warn_once(
                f"shared:{logical}",
                f"gradaudit: parameter {logical!r} is marked shared (tied across pipeline stages) but has no "
                f"alias; pass aliases={{{logical!r}: <logical name>}} or it is counted as a parameter of its own",
            )
        group = dp_group if is_megatron_sharded(param) else replicated_group
        make = functools.partial(
            plain_pieces,
            *_names(logical, alias_of),
            param,
            replica_group=group,
            tensor_parallel=tensor_parallel,
        )
        _extend(pieces, on_unsupported, logical, make)
    return pieces


def megatron_expert_pieces(
    logical: str,
    param: torch.Tensor,
    experts: ExpertRank | None,
    alias_of: Mapping[str, str],
    tensor_parallel: TensorParallelRank | None,
    problem: Exception | None = None,
) -> list[LocalPiece]:
    """A Megatron-style expert: a whole parameter (or its tensor-parallel partition) of one global expert,
    replicated over the expert-data-parallel group."""
    if problem is not None:
        raise problem
    name = global_expert_name(logical, experts)
    assert experts is not None  # global_expert_name refuses None
    target, local_name = _names(logical, alias_of)
    return plain_pieces(
        name if target == logical else target,
        logical if local_name is None else local_name,
        param,
        replica_group=experts.replica_group,
        tensor_parallel=tensor_parallel,
    )


def _extend(
    pieces: list[LocalPiece],
    on_unsupported: Callable[[str, Exception], None],
    name: str,
    make: Callable[[], list[LocalPiece]],
) -> None:
    try:
        pieces.extend(make())
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001  an unexpected parameter type must cost that parameter, not the step
        on_unsupported(name, exc)


def _names(logical: str, alias_of: Mapping[str, str]) -> tuple[str, str | None]:
    """(logical name after aliases, this rank's name when it differs)."""
    if not alias_of:
        return logical, None
    target = alias_of.get(logical)
    return (target, logical) if target and target != logical else (logical, None)


def _aliased(piece: LocalPiece, alias_of: Mapping[str, str]) -> LocalPiece:
    target = alias_of.get(piece.param)
    if not target or target == piece.param:
        return piece
    return dataclasses.replace(piece, param=target, local_name=piece.param)


def _local_aliases(pieces: LocalPieces) -> dict[str, str]:
    return {
        local: param
        for param, local in zip(pieces.params, pieces.local_names, strict=True)
        if local and local != param
    }


def _check_aliases(aliases: Mapping[str, str], known: set[str]) -> None:
    """Refuse aliases that are not str -> str, or whose key names no parameter (`known`: the
    logical names and FQNs of this rank's parameters)."""
    for key, value in aliases.items():
        if not isinstance(key, str) or not isinstance(value, str) or not value:
            raise CaptureError(
                f"aliases must map parameter names to logical names (str -> str), got {key!r}: {value!r}"
            )
        if key not in known:
            some = ", ".join(sorted(known)[:5]) or "(this rank has no parameters)"
            raise CaptureError(
                f"aliases key {key!r} is not a parameter of the model on this rank; keys are this rank's own "
                f"parameter names (e.g. {some}) and values the logical name they stand for"
            )


def _fsdp1_pieces(
    model: torch.nn.Module, topology: TopologyBuilder, exclude: frozenset[str]
) -> list[LocalPiece] | None:
    pieces = fsdp1_pieces(model, exclude=exclude)
    if pieces is not None:
        for name, lists in fsdp1_groups(model).items():
            topology.add_group(name, lists)
    return pieces


def _data_parallel_group(
    model: torch.nn.Module, topology: TopologyBuilder, groups: Mapping[str, tuple[tuple[int, ...], ...]]
) -> str | None:
    """The group DDP replicates over (named after a matching user group), else the user's 'dp' group."""
    for module in model.modules():
        if is_ddp(module):
            pg = getattr(module, "process_group", None)
            import torch.distributed as dist

            ranks = (
                tuple(dist.get_process_group_ranks(pg))
                if pg is not None
                else tuple(range(topology.world_size))
            )
            return topology.name_of(ranks, default="ddp")
    return DATA_PARALLEL_GROUP_NAME if DATA_PARALLEL_GROUP_NAME in groups else None


def _tensor_parallel_rank(
    topology: TopologyBuilder, groups: Mapping[str, tuple[tuple[int, ...], ...]]
) -> TensorParallelRank | None:
    for name in TENSOR_PARALLEL_GROUP_NAMES:
        if name in groups:
            ranks = topology.my_ranks(name)
            if ranks is None:
                raise CaptureError(
                    f"groups[{name!r}] does not contain this rank ({topology.rank}); pass the tensor-parallel "
                    "group this rank belongs to"
                )
            return TensorParallelRank(group=name, size=len(ranks), index=ranks.index(topology.rank))
    return None


def _plain_groups(
    model: torch.nn.Module,
    topology: TopologyBuilder,
    world_size: int,
    groups: Mapping[str, tuple[tuple[int, ...], ...]],
) -> tuple[str | None, TensorParallelRank | None, str | None]:
    """(the data-parallel group, this rank's tensor-parallel place, and the group a plain (unsharded)
    parameter is replicated over on this rank: data and tensor parallel, else the largest mesh, else
    the data-parallel group, else the world when no group was given)."""
    dp_group = _data_parallel_group(model, topology, groups)
    tensor_parallel = _tensor_parallel_rank(topology, groups)
    if tensor_parallel is not None:
        tp_group = tensor_parallel.group
        return dp_group, tensor_parallel, tp_group if dp_group is None else f"{dp_group}+{tp_group}"
    replicated = (
        topology.largest_mesh_group() or dp_group or (WORLD if world_size > 1 and not groups else None)
    )
    return dp_group, tensor_parallel, replicated
