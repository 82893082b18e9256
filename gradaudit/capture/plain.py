"""Ownership of plain-tensor parameters: whole replicas (single process, DDP, beside tensor parallel)
and Megatron-style tensor-parallel shards marked by attributes on the tensor."""

from __future__ import annotations

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
    local_shape = tuple(int(s) for s in param.shape)
    if any(s == 0 for s in local_shape):
        return []
    offsets = [0] * len(local_shape)
    global_shape = list(local_shape)
    if is_megatron_sharded(param):
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
    return [
        LocalPiece(
            param=name,
            global_shape=tuple(global_shape),
            dtype=str(param.dtype).removeprefix("torch."),
            regions=(Box(offsets=tuple(offsets), shape=local_shape),),
            local_shape=local_shape,
            grad=_grad_of(param),
            value=_value_of(param),
            replica_group=replica_group,
            local_name=local_name,
        )
    ]


def _grad_of(param: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    def grad() -> torch.Tensor | None:
        g = param.grad
        return None if g is None else g.detach()

    return grad


def _value_of(param: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    def value() -> torch.Tensor | None:
        return param.detach()

    return value
