"""Ownership of plain-tensor parameters: whole replicas (single process, DDP, beside tensor parallel)
and Megatron-style tensor-parallel shards marked by attributes on the tensor."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import Box
from .errors import UnsupportedParameter
from .ownership import LocalPiece

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class TensorParallelRank:
    """This rank's place in the tensor-parallel group given with groups= (Megatron-style models)."""

    group: str
    """The `groups=` name of the tensor-parallel group."""
    size: int
    """Ranks in this rank's tensor-parallel list."""
    index: int
    """This rank's position in that list."""


def is_megatron_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def plain_pieces(
    name: str,
    local_name: str | None,
    param: torch.Tensor,
    *,
    replica_group: str | None,
    tensor_parallel: TensorParallelRank | None = None,
) -> list[LocalPiece]:
    """The one piece of a plain parameter: all of it, or its tensor-parallel partition (Megatron)."""
    local_shape = tuple(param.shape)
    if 0 in local_shape:
        return []
    if not is_megatron_sharded(param):
        return whole_pieces(name, local_name, param, replica_group)
    offsets = [0] * len(local_shape)
    global_shape = list(local_shape)
    if tensor_parallel is None:
        raise UnsupportedParameter(
            f"parameter {name!r} is marked tensor_model_parallel but no tensor-parallel group was given; "
            "pass groups={'tp': <its tensor-parallel ProcessGroup>}"
        )
    dim = int(getattr(param, "partition_dim", 0)) % max(len(local_shape), 1)
    stride = int(getattr(param, "partition_stride", 1))
    if stride != 1:
        raise UnsupportedParameter(
            f"parameter {name!r} has partition_stride={stride}; only stride 1 is mapped. "
            "Pass its pieces with ownership="
        )
    global_shape[dim] = local_shape[dim] * tensor_parallel.size
    offsets[dim] = local_shape[dim] * tensor_parallel.index
    region = Box(offsets=tuple(offsets), shape=local_shape)
    return [_piece(name, local_name, param, tuple(global_shape), local_shape, (region,), replica_group)]


def whole_pieces(
    name: str, local_name: str | None, param: torch.Tensor, replica_group: str | None
) -> list[LocalPiece]:
    """The one piece of a parameter this rank holds whole (none when it has no elements)."""
    local_shape = tuple(param.shape)
    if 0 in local_shape:
        return []
    return [
        _piece(name, local_name, param, local_shape, local_shape, _whole_regions(local_shape), replica_group)
    ]


def _piece(
    name: str,
    local_name: str | None,
    param: torch.Tensor,
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    regions: tuple[Box, ...],
    replica_group: str | None,
) -> LocalPiece:
    """A LocalPiece filled in directly: a rank may hold 10^5 parameters, and the frozen dataclass's
    __init__ (one object.__setattr__ a field) was a fifth of the stats capture of small ones. It
    has no __post_init__ to skip; the fields left out take their declared defaults."""
    piece = _new(LocalPiece)
    piece.__dict__.update(
        _PIECE_DEFAULTS,
        param=name,
        global_shape=global_shape,
        dtype=_dtype_name(param.dtype),
        regions=regions,
        local_shape=local_shape,
        grad=_grad_of(param),
        value=param.detach,
        replica_group=replica_group,
        local_name=local_name,
    )
    return piece


_new = object.__new__
_PIECE_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(LocalPiece) if f.default is not dataclasses.MISSING
}


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=256)
def _whole_regions(shape: tuple[int, ...]) -> tuple[Box]:
    """The regions of a whole tensor of `shape` (shared: a model's parameters have a few shapes, and
    a Box is frozen)."""
    return (Box(offsets=(0,) * len(shape), shape=shape),)


def _grad_of(param: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    def grad() -> torch.Tensor | None:
        g = param.grad
        return g.detach() if g is not None and g.requires_grad else g

    return grad
