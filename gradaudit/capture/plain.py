"""Ownership of plain-tensor parameters: whole replicas (single process, DDP, beside tensor parallel)
and Megatron-style tensor-parallel shards marked by attributes on the tensor."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from ..model import Box, Region
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


@dataclass(frozen=True, kw_only=True)
class WholeRows:
    """The rows of a LocalPieces that hold a whole plain tensor (single process, DDP: a rank may
    hold 10^5), grouped so that their gradients are read and summarized in bulk."""

    positions: np.ndarray
    """Their positions among the rows, ascending (int64)."""
    names: Sequence[str]
    """Their logical names, in the order of `positions`."""
    tensors: Sequence[torch.Tensor]
    """The parameters, in the order of `positions`."""
    kinds: Sequence[tuple[tuple[int, ...], torch.dtype, torch.device]]
    """The distinct (shape, dtype, device) of the parameters (a grad has its parameter's: torch
    refuses any other)."""
    codes: np.ndarray
    """Per parameter, the index of its kind in `kinds` (int64)."""
    groups: dict[tuple[Any, ...], list[int]]
    """Each kind -> the indices (into `tensors`) of its parameters, ascending."""


def whole_rows(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> WholeRows:
    """Whole rows of `tensors` (plain tensors without marks), the first rows: a key per tensor, the
    rest per kind."""
    keys = [(t.shape, t.dtype, t.device) for t in tensors]
    found = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    codes = np.fromiter(map(found.__getitem__, keys), dtype=np.int64, count=len(keys))
    kinds = [(tuple(size), dtype, device) for size, dtype, device in found]
    order = np.argsort(codes, kind="stable")
    bounds = np.searchsorted(codes[order], np.arange(len(kinds) + 1))
    groups = {kind: order[bounds[i] : bounds[i + 1]].tolist() for i, kind in enumerate(kinds)}
    return WholeRows(
        positions=np.arange(len(names)), names=names, tensors=tensors, kinds=kinds, codes=codes, groups=groups
    )


@dataclass(eq=False, repr=False, kw_only=True)
class LocalPieces(Sequence[LocalPiece]):
    """A rank's pieces as columns, in order; a LocalPiece is the row view, built when one is read.

    A row that is a whole plain parameter holds the tensor itself (`tensors`; `whole` groups those
    rows, read in bulk) and no reader; any other holds its LocalPiece's readers."""

    params: list[str]
    """Per row, the logical parameter it is a piece of."""
    global_shapes: list[tuple[int, ...]]
    """Per row, the whole parameter's shape."""
    dtypes: list[str]
    """Per row, the parameter's dtype name."""
    regions: list[tuple[Region, ...]]
    """Per row, the elements of the parameter this rank holds."""
    local_shapes: list[tuple[int, ...]]
    """Per row, the shape of the local tensor."""
    replica_groups: list[str | None]
    """Per row, the process group the piece is replicated over (None: this rank's alone)."""
    local_names: list[str | None]
    """Per row, the name in this rank's module when it differs from the logical one."""
    readers: list[tuple[Callable[[], Any], Callable[[], Any], Any] | None]
    """(grad, value, grad_partial) of a row without a tensor, None for one with."""
    tensors: list[torch.Tensor | None]
    """Per row, the whole plain parameter it holds (None: the row is read through `readers`)."""
    whole: WholeRows | None
    """The rows that hold a tensor, None when none does."""
    _positions: dict[str, list[int]] | None = field(default=None, init=False, repr=False)
    """Parameter -> its rows, built when first asked for."""

    @classmethod
    def of(cls, pieces: Sequence[LocalPiece]) -> LocalPieces:
        """The columns of `pieces`."""
        return cls(
            params=[p.param for p in pieces],
            global_shapes=[p.global_shape for p in pieces],
            dtypes=[p.dtype for p in pieces],
            regions=[p.regions for p in pieces],
            local_shapes=[p.local_shape for p in pieces],
            replica_groups=[p.replica_group for p in pieces],
            local_names=[p.local_name for p in pieces],
            readers=[(p.grad, p.value, p.grad_partial) for p in pieces],
            tensors=[None] * len(pieces),
            whole=None,
        )

    @classmethod
    def of_whole(cls, rows: WholeRows, replica_group: str | None) -> LocalPieces:
        """Whole replicas over `replica_group` of `rows.tensors` (none of them empty), held without
        a LocalPiece each."""
        shapes = [rows.kinds[code][0] for code in rows.codes.tolist()]
        names = [dtype_name(dtype) for _, dtype, _ in rows.kinds]
        count = len(shapes)
        return cls(
            params=list(rows.names),
            global_shapes=shapes,
            dtypes=[names[code] for code in rows.codes.tolist()],
            regions=list(map(_whole_regions, shapes)),
            local_shapes=shapes,
            replica_groups=[replica_group] * count,
            local_names=[None] * count,
            readers=[None] * count,
            tensors=list(rows.tensors),
            whole=rows,
        )

    @classmethod
    def joined(cls, parts: Sequence[LocalPieces]) -> LocalPieces:
        """The rows of `parts`, one after another (one of them at most holds whole rows)."""
        offsets = itertools.accumulate((len(part) for part in parts), initial=0)
        holding = [
            (offset, part.whole)
            for offset, part in zip(offsets, parts, strict=False)
            if part.whole is not None
        ]
        assert len(holding) <= 1, "one part at most holds whole rows"
        whole = None
        if holding:
            offset, rows = holding[0]
            whole = dataclasses.replace(rows, positions=rows.positions + offset)
        return cls(
            **{name: [x for part in parts for x in getattr(part, name)] for name in _COLUMNS}, whole=whole
        )

    def __len__(self) -> int:
        return len(self.params)

    @overload
    def __getitem__(self, index: int) -> LocalPiece: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[LocalPiece, ...]: ...

    def __getitem__(self, index: int | slice) -> LocalPiece | tuple[LocalPiece, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("piece index out of range")
        tensor, readers = self.tensors[index], self.readers[index]
        if readers is None:
            assert tensor is not None  # a row holds its tensor or its readers
            readers = (functools.partial(grad_now, tensor), tensor.detach, None)
        grad, value, grad_partial = readers
        return _filled(
            param=self.params[index],
            global_shape=self.global_shapes[index],
            dtype=self.dtypes[index],
            regions=self.regions[index],
            local_shape=self.local_shapes[index],
            grad=grad,
            value=value,
            replica_group=self.replica_groups[index],
            local_name=self.local_names[index],
            grad_partial=grad_partial,
        )

    def edited(self, changes: Mapping[int, LocalPiece | None]) -> LocalPieces:
        """These rows with each row `changes` names (one read one by one) replaced by its piece, or
        dropped where that is None."""
        if not changes:
            return self
        kept = [i for i in range(len(self)) if changes.get(i, self) is not None]
        columns = {name: [getattr(self, name)[i] for i in kept] for name in _COLUMNS}
        for new, old in enumerate(kept):
            piece = changes.get(old)
            if piece is not None:
                row = LocalPieces.of([piece])
                for name in _COLUMNS:
                    columns[name][new] = getattr(row, name)[0]
        whole = self.whole
        if whole is not None:
            new_of = {old: new for new, old in enumerate(kept)}
            positions = np.array([new_of[i] for i in whole.positions.tolist()], dtype=np.int64)
            whole = dataclasses.replace(whole, positions=positions)
        return LocalPieces(**columns, whole=whole)

    def read_one_by_one(self) -> list[int]:
        """The positions of the rows read through their readers, not in bulk."""
        return [i for i, tensor in enumerate(self.tensors) if tensor is None]

    def positions_of(self, param: str) -> list[int]:
        """The positions of `param`'s pieces (an index built at the first call: a step that leaves
        out many parameters must not scan every piece for each)."""
        if self._positions is None:
            self._positions = {}
            for index, name in enumerate(self.params):
                self._positions.setdefault(name, []).append(index)
        return self._positions.get(param, [])


_COLUMNS = tuple(f.name for f in dataclasses.fields(LocalPieces) if f.init and f.name != "whole")
"""The columns of a LocalPieces, one entry a row each."""


def whole_pieces(
    name: str, local_name: str | None, param: torch.Tensor, replica_group: str | None
) -> list[LocalPiece]:
    """The one piece of a parameter this rank holds whole (none when it has no elements)."""
    local_shape = tuple(param.shape)
    if 0 in local_shape:
        return []
    regions = _whole_regions(local_shape)
    return [_piece(name, local_name, param, local_shape, local_shape, regions, replica_group)]


def _piece(
    name: str,
    local_name: str | None,
    param: torch.Tensor,
    global_shape: tuple[int, ...],
    local_shape: tuple[int, ...],
    regions: tuple[Box, ...],
    replica_group: str | None,
) -> LocalPiece:
    return _filled(
        param=name,
        global_shape=global_shape,
        dtype=dtype_name(param.dtype),
        regions=regions,
        local_shape=local_shape,
        grad=functools.partial(grad_now, param),
        value=param.detach,
        replica_group=replica_group,
        local_name=local_name,
        grad_partial=None,
    )


def _filled(**fields: Any) -> LocalPiece:
    """A LocalPiece filled in directly (every field given): a rank may hold 10^5 parameters, and the
    frozen dataclass's __init__ (one object.__setattr__ a field) was a fifth of the stats capture of
    small ones. It has no __post_init__ to skip."""
    piece = _new(LocalPiece)
    piece.__dict__.update(fields)
    return piece


_new = object.__new__


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=256)
def _whole_regions(shape: tuple[int, ...]) -> tuple[Box]:
    """The regions of a whole tensor of `shape` (shared: a model's parameters have a few shapes, and
    a Box is frozen)."""
    return (Box(offsets=(0,) * len(shape), shape=shape),)


def grad_now(param: torch.Tensor) -> torch.Tensor | None:
    """`param`'s gradient now (detached), or None."""
    g = param.grad
    return g.detach() if g is not None and g.requires_grad else g
