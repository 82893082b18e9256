"""Ownership of plain-tensor parameters: whole replicas (single process, DDP, beside tensor parallel)
and Megatron-style tensor-parallel shards marked by attributes on the tensor."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

from ..model import Box
from .errors import UnsupportedParameter
from .ownership import LocalPiece

if TYPE_CHECKING:
    import numpy as np
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


@dataclass(frozen=True, kw_only=True)
class WholeReplicas:
    """Plain parameters this rank holds whole, replicated over one group, as columns: the common case
    (single process, DDP), held without a LocalPiece per parameter (a rank may hold 10^5)."""

    names: Sequence[str]
    """Logical names (no aliases: a parameter with one is a LocalPiece)."""
    tensors: Sequence[torch.Tensor]
    """The parameters, in the order of `names`."""
    kinds: Sequence[tuple[tuple[int, ...], torch.dtype, torch.device]]
    """The distinct (shape, dtype, device) of the parameters (a grad has its parameter's: torch
    refuses any other)."""
    codes: np.ndarray
    """Per parameter, the index of its kind in `kinds` (int64)."""
    groups: dict[tuple[Any, ...], list[int]]
    """Each kind -> the positions of its parameters, ascending."""
    replica_group: str | None
    """The process group every one of them is replicated over (None: this rank alone holds them)."""

    def shape(self, position: int) -> tuple[int, ...]:
        return self.kinds[int(self.codes[position])][0]


def whole_replicas(
    names: Sequence[str], tensors: Sequence[torch.Tensor], replica_group: str | None
) -> WholeReplicas:
    """The columns of `tensors` (plain tensors without marks, none of them empty): a key per tensor,
    the rest per kind."""
    import numpy as np

    keys = [(t.shape, t.dtype, t.device) for t in tensors]
    found = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    codes = np.fromiter(map(found.__getitem__, keys), dtype=np.int64, count=len(keys))
    kinds = [(tuple(size), dtype, device) for size, dtype, device in found]
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(kinds) + 1))
    groups = {kind: order[bounds[i] : bounds[i + 1]].tolist() for i, kind in enumerate(kinds)}
    return WholeReplicas(
        names=names, tensors=tensors, kinds=kinds, codes=codes, groups=groups, replica_group=replica_group
    )


class LocalPieces(Sequence[LocalPiece]):
    """A rank's pieces in order: LocalPiece objects (`head`), the whole replicas held as columns, more
    objects (`tail`). A replica's LocalPiece is built only when one is read; the capture reads the
    columns (`replicas`, `start`) directly."""

    def __init__(
        self,
        head: Sequence[LocalPiece],
        replicas: WholeReplicas | None = None,
        tail: Sequence[LocalPiece] = (),
    ) -> None:
        self.head, self.replicas, self.tail = tuple(head), replicas, tuple(tail)
        self.start = len(self.head)
        """The position of the first replica."""
        self.stop = self.start + (len(replicas.names) if replicas is not None else 0)
        """The position after the last replica."""
        self._built: dict[int, LocalPiece] = {}
        self._positions: dict[str, list[int]] | None = None
        """The replicas' LocalPieces built so far (read one by one: full mode, values kept)."""

    def __len__(self) -> int:
        return self.stop + len(self.tail)

    @overload
    def __getitem__(self, index: int) -> LocalPiece: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[LocalPiece, ...]: ...

    def __getitem__(self, index: int | slice) -> LocalPiece | tuple[LocalPiece, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
            if index < 0:
                raise IndexError("piece index out of range")
        if index < self.start:
            return self.head[index]
        if index >= self.stop:
            return self.tail[index - self.stop]
        built = self._built.get(index)
        if built is None:
            replicas = self.replicas
            assert replicas is not None
            j = index - self.start
            shape = replicas.shape(j)
            built = self._built[index] = _piece(
                replicas.names[j],
                None,
                replicas.tensors[j],
                shape,
                shape,
                _whole_regions(shape),
                replicas.replica_group,
            )
        return built

    def __iter__(self) -> Iterator[LocalPiece]:
        yield from self.head
        for j in range(self.stop - self.start):
            yield self[self.start + j]
        yield from self.tail

    def objects(self) -> Iterator[tuple[int, LocalPiece]]:
        """(position, piece) of the pieces held as objects."""
        yield from enumerate(self.head)
        yield from enumerate(self.tail, self.stop)

    def param(self, index: int) -> str:
        """The logical name of the piece at `index`, without building it."""
        if self.start <= index < self.stop:
            assert self.replicas is not None
            return self.replicas.names[index - self.start]
        return self[index].param

    def names(self, index: int) -> tuple[str, str | None]:
        """(logical name, this rank's name when it differs) of the piece at `index`."""
        if self.start <= index < self.stop:
            return self.param(index), None
        piece = self[index]
        return piece.param, piece.local_name

    def positions_of(self, param: str) -> list[int]:
        """The positions of `param`'s pieces (an index built at the first call: a step that leaves
        out many parameters must not scan every piece for each)."""
        if self._positions is None:
            self._positions = {}
            for index in range(len(self)):
                self._positions.setdefault(self.param(index), []).append(index)
        return self._positions.get(param, [])


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
        dtype=dtype_name(param.dtype),
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
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=256)
def _whole_regions(shape: tuple[int, ...]) -> tuple[Box]:
    """The regions of a whole tensor of `shape` (shared: a model's parameters have a few shapes, and
    a Box is frozen)."""
    return (Box(offsets=(0,) * len(shape), shape=shape),)


def _grad_of(param: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    return functools.partial(grad_now, param)


def grad_now(param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s gradient now (detached), or None."""
    g = param.grad
    return g.detach() if g is not None and g.requires_grad else g
