"""Ownership and topology of FSDP1 (`FullyShardedDataParallel`) models: each FlatParameter's local
shard mapped back to flat ranges of the original parameters it holds."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CaptureError
from ..model import FlatRange
from ..warn import warn_once
from .names import logical_name
from .ownership import LocalPiece
from .plain import plain_pieces
from .topology import WORLD

if TYPE_CHECKING:
    import torch

SHARD_GROUP = "dp_shard"
REPLICATE_GROUP = "dp_replicate"
NO_SHARD_GROUP = "dp"

_SHARDED_STRATEGIES = frozenset({"FULL_SHARD", "SHARD_GRAD_OP"})
_HYBRID_STRATEGIES = frozenset({"HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"})
_KNOWN_STRATEGIES = _SHARDED_STRATEGIES | _HYBRID_STRATEGIES | {"NO_SHARD"}

_LAYOUT_HINT = (
    "this torch version stores FSDP1 shards differently than gradaudit expects; "
    "pass ownership= to gradaudit.audit_step explicitly, or report the torch version"
)


@dataclass(frozen=True, kw_only=True)
class ParamShard:
    """This rank's part of one original parameter inside a FlatParameter's local shard."""

    index: int
    """Position of the parameter among the FlatParameter's original (non-padding) parameters."""
    fqn: str
    """Name relative to the module FSDP wraps, as FSDP records it (may hold wrapper names)."""
    global_shape: tuple[int, ...]
    """Shape of the whole original parameter."""
    offset_in_shard: int
    """Where this part starts in the rank's local shard, in elements."""
    numel_in_shard: int
    """Elements of the parameter in the local shard (`stop - start`)."""
    start: int
    """First element of the row-major flattened parameter held here; `stop` is one past the last."""
    stop: int
    """One past the last element held (see `start`)."""

    def held_in(self, shard: torch.Tensor) -> torch.Tensor:
        """This parameter's part of the rank's local flat shard (or of its gradient)."""
        return shard.detach()[self.offset_in_shard : self.offset_in_shard + self.numel_in_shard]


@dataclass(frozen=True, kw_only=True)
class _Unit:
    """One FSDP1 module that owns a FlatParameter, with the module path of the module it wraps."""

    prefix: str
    """Path (as model.named_modules() gives it) of the module the FlatParameter's `_fqns` start from."""
    flat_param: Any
    strategy: str
    use_orig_params: bool
    orig_dtype: Any
    shard_ranks: tuple[int, ...]
    replicate_ranks: tuple[int, ...] | None


def param_shards(flat_param: Any) -> list[ParamShard]:
    """The original parameters present in this rank's shard of `flat_param` (padding excluded).

    Reads FSDP1's per-parameter metadata (`_fqns`, `_shapes`, `_numels`, `_contiguities`,
    `_shard_param_infos`, `_sharded_size`) and checks it for consistency, raising CaptureError when
    it cannot be read as expected.
    """
    try:
        fqns = tuple(flat_param._fqns)
        shapes = tuple(tuple(int(d) for d in s) for s in flat_param._shapes)
        numels = tuple(int(n) for n in flat_param._numels)
        contiguities = tuple(getattr(flat_param, "_contiguities", (True,) * len(fqns)))
        infos = tuple(flat_param._shard_param_infos)
        sharded_numel = _numel(flat_param._sharded_size)
    except (AttributeError, TypeError) as exc:
        raise CaptureError(
            f"cannot read an FSDP1 FlatParameter's shard metadata ({exc}): {_LAYOUT_HINT}"
        ) from None
    if not len(fqns) == len(shapes) == len(numels) == len(infos) == len(contiguities):
        raise CaptureError(
            f"FSDP1 FlatParameter metadata of {list(fqns)} has per-parameter lists of different lengths: {_LAYOUT_HINT}"
        )
    shards = []
    for index, (fqn, shape, numel, contiguous, info) in enumerate(
        zip(fqns, shapes, numels, contiguities, infos, strict=False)
    ):
        try:
            in_shard, offset, numel_in_shard, start, end_inclusive = tuple(info)
        except (TypeError, ValueError):
            raise CaptureError(
                f"FSDP1 shard info of {fqn} is {info!r}, not the 5 fields expected: {_LAYOUT_HINT}"
            ) from None
        if not in_shard or numel == 0:
            continue
        if not all(isinstance(v, int) for v in (offset, numel_in_shard, start, end_inclusive)):
            raise CaptureError(f"FSDP1 shard info of {fqn} is {info!r}, not integer offsets: {_LAYOUT_HINT}")
        stop = end_inclusive + 1
        consistent = (
            0 <= start <= stop <= numel
            and numel_in_shard == stop - start
            and offset >= 0
            and offset + numel_in_shard <= sharded_numel
            and _numel(shape) == numel
        )
        if not consistent:
            raise CaptureError(
                f"FSDP1 shard info of {fqn} ({info!r}, numel {numel}, shard numel {sharded_numel}) "
                f"is not a range of the parameter: {_LAYOUT_HINT}"
            )
        if not contiguous:
            raise CaptureError(
                f"parameter {fqn} is not contiguous, so FSDP1 flattened it in storage order and its "
                "shard is not a row-major range; make it contiguous before wrapping, or pass ownership="
            )
        shards.append(
            ParamShard(
                index=index,
                fqn=fqn,
                global_shape=shape,
                offset_in_shard=offset,
                numel_in_shard=numel_in_shard,
                start=start,
                stop=stop,
            )
        )
    return shards


def fsdp1_pieces(model: torch.nn.Module, *, exclude: frozenset[str] = frozenset()) -> list[LocalPiece] | None:
    """One LocalPiece per original parameter present in this rank's FSDP1 shards, and one whole replica
    per parameter FSDP1 does not manage (ignored_modules / ignored_states) unless named in `exclude`
    (given with ownership=); None without FSDP1."""
    units = _fsdp1_units(model)
    if units is None:
        return None
    pieces = []
    for unit in units:
        replica_group = _replica_group(unit.strategy)
        dtype = str(unit.orig_dtype).removeprefix("torch.")
        for shard in param_shards(unit.flat_param):
            name = logical_name(model, _join(unit.prefix, shard.fqn))
            pieces.append(
                LocalPiece(
                    param=name,
                    global_shape=shard.global_shape,
                    dtype=dtype,
                    regions=(FlatRange(start=shard.start, stop=shard.stop),),
                    local_shape=(shard.numel_in_shard,),
                    grad=_grad_reader(unit, shard, name),
                    value=_value_reader(unit, shard, name),
                    replica_group=replica_group,
                )
            )
    unmanaged = [(name, param) for name, param in _unmanaged_parameters(model, units) if name not in exclude]
    for name, param in unmanaged:
        pieces.extend(plain_pieces(name, None, param, replica_group=WORLD))
    if unmanaged:
        names = ", ".join(name for name, _ in unmanaged)
        warn_once(
            "fsdp1-unmanaged:" + names,
            f"gradaudit: parameters {names} are not managed by FSDP1 (ignored_modules / ignored_states); they "
            "are audited as whole replicas on every rank (FSDP1 does not reduce their gradients: your code "
            "must). If each rank holds different values, pass them with ownership=",
        )
    return pieces


def fsdp1_groups(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], ...]]:
    """This rank's view of the FSDP1 process groups: {"dp_shard", "dp_replicate"} or {"dp"} (NO_SHARD)."""
    groups: dict[str, tuple[int, ...]] = {}
    for unit in _fsdp1_units(model) or []:
        _add_group(groups, NO_SHARD_GROUP if unit.strategy == "NO_SHARD" else SHARD_GROUP, unit.shard_ranks)
        if unit.replicate_ranks is not None:  # the hybrid strategies
            _add_group(groups, REPLICATE_GROUP, unit.replicate_ranks)
    return {name: (ranks,) for name, ranks in sorted(groups.items())}


def _add_group(groups: dict[str, tuple[int, ...]], name: str, ranks: tuple[int, ...]) -> None:
    if groups.setdefault(name, ranks) != ranks:
        raise CaptureError(
            f"FSDP1 modules of this model use different process groups as {name} "
            f"({list(groups[name])} and {list(ranks)}); pass groups= and ownership= to gradaudit.audit_step"
        )


def _replica_group(strategy: str) -> str | None:
    if strategy == "NO_SHARD":
        return NO_SHARD_GROUP
    if strategy in _HYBRID_STRATEGIES:
        return REPLICATE_GROUP
    return None


def _fsdp1_units(model: torch.nn.Module) -> list[_Unit] | None:
    fsdp_class = _fsdp1_class()
    if fsdp_class is None:
        return None
    found = [(path, m) for path, m in model.named_modules() if isinstance(m, fsdp_class)]
    if not found:
        return None
    handles = ((path, module, _handle_of(module, path)) for path, module in found)  # one module at a time
    return [_unit_of(path, module, handle) for path, module, handle in handles if handle is not None]


def _unmanaged_parameters(model: torch.nn.Module, units: list[_Unit]) -> list[tuple[str, Any]]:
    managed: set[int] = set()
    for unit in units:
        managed.add(id(unit.flat_param))
        for attribute in ("_params", "_shared_params"):  # the original parameters, use_orig_params=True
            managed.update(id(p) for p in getattr(unit.flat_param, attribute, None) or ())
    return [
        (logical_name(model, fqn), param)
        for fqn, param in model.named_parameters()
        if id(param) not in managed and not getattr(param, "_is_flat_param", False) and param.requires_grad
    ]


def _fsdp1_class() -> type | None:
    """FSDP1's class, or None when it was never imported (then no model can hold an FSDP1 module,
    and the costly import is skipped)."""
    module = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    return getattr(module, "FullyShardedDataParallel", None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _handle_of(module: Any, prefix: str) -> Any:
    if "_handle" in vars(module):  # None for a module without parameters
        return vars(module)["_handle"]
    raise CaptureError(
        f"cannot find the FlatParameter handle of the FSDP1 module {prefix or '<root>'}: {_LAYOUT_HINT}"
    )


def _unit_of(path: str, module: Any, handle: Any) -> _Unit:
    import torch.distributed as dist

    where = path or "<root>"
    strategy = getattr(vars(module).get("sharding_strategy"), "name", None)
    if strategy not in _KNOWN_STRATEGIES:
        raise CaptureError(
            f"FSDP1 module {where} has an unknown sharding strategy {strategy!r}: {_LAYOUT_HINT}"
        )
    flat_param = getattr(handle, "flat_param", None)
    shard_pg = vars(module).get("process_group")
    if flat_param is None or shard_pg is None:
        raise CaptureError(
            f"cannot read the FlatParameter or process group of the FSDP1 module {where}: {_LAYOUT_HINT}"
        )
    replicate_ranks = None
    if strategy in _HYBRID_STRATEGIES:
        inter_node_pg = vars(module).get("_inter_node_pg")
        if inter_node_pg is None:
            raise CaptureError(
                f"cannot find the inter-node group of the HYBRID_SHARD module {where}: {_LAYOUT_HINT}"
            )
        replicate_ranks = tuple(dist.get_process_group_ranks(inter_node_pg))
    return _Unit(
        prefix=_join(path, "_fsdp_wrapped_module"),
        flat_param=flat_param,
        strategy=strategy,
        use_orig_params=bool(getattr(handle, "_use_orig_params", False)),
        orig_dtype=getattr(handle, "_orig_param_dtype", None) or flat_param.dtype,
        shard_ranks=tuple(dist.get_process_group_ranks(shard_pg)),
        replicate_ranks=replicate_ranks,
    )


def _grad_reader(unit: _Unit, shard: ParamShard, name: str) -> Callable[[], torch.Tensor | None]:
    """The gradient the optimizer will read: the original parameter's `.grad` (a view into the sharded
    flat gradient, 1-D for sharded strategies, of the original shape under NO_SHARD) when
    use_orig_params=True, else the matching slice of the FlatParameter's sharded `.grad`."""

    def read() -> torch.Tensor | None:
        flat_grad: torch.Tensor | None = unit.flat_param.grad
        _check_grad_is_sharded(unit, flat_grad, name)
        if unit.use_orig_params:
            grad = _orig_param(unit, shard, name).grad
            if grad is None:
                return None
            if grad.numel() != shard.numel_in_shard:
                raise CaptureError(
                    f"the gradient of {name} has {grad.numel()} elements, not "
                    f"the {shard.numel_in_shard} of this rank's FSDP1 shard; capture after backward, outside no_sync()"
                )
            return grad.detach().reshape(-1)
        return None if flat_grad is None else shard.held_in(flat_grad)

    return read


def _value_reader(unit: _Unit, shard: ParamShard, name: str) -> Callable[[], torch.Tensor | None]:
    def read() -> torch.Tensor | None:
        if unit.use_orig_params:
            param = _orig_param(unit, shard, name)
            if param.numel() == shard.numel_in_shard:
                return param.detach().reshape(-1)
        flat = _sharded_flat_param(unit)
        return None if flat is None else shard.held_in(flat)

    return read


def _orig_param(unit: _Unit, shard: ParamShard, name: str) -> torch.Tensor:
    params: list[torch.Tensor] | None = getattr(unit.flat_param, "_params", None)
    if params is None or len(params) <= shard.index:
        raise CaptureError(
            f"cannot find the original parameter {name} of an FSDP1 "
            f"use_orig_params=True FlatParameter: {_LAYOUT_HINT}"
        )
    return params[shard.index]


def _sharded_flat_param(unit: _Unit) -> torch.Tensor | None:
    """The FlatParameter's local shard: itself when resharded, else its saved `_local_shard`."""
    sharded_numel = _numel(unit.flat_param._sharded_size)
    local_shard: torch.Tensor | None = getattr(unit.flat_param, "_local_shard", None)
    for candidate in (unit.flat_param, local_shard):
        if candidate is not None and candidate.numel() == sharded_numel:
            return candidate
    return None


def _check_grad_is_sharded(unit: _Unit, flat_grad: torch.Tensor | None, name: str) -> None:
    if flat_grad is None:
        return
    sharded_numel = _numel(unit.flat_param._sharded_size)
    if flat_grad.numel() != sharded_numel:
        raise CaptureError(
            f"the FSDP1 flat gradient holding {name} has {flat_grad.numel()} elements instead of the "
            f"{sharded_numel} of this rank's shard: it is not reduced yet (inside no_sync(), or captured during "
            "backward); capture after the backward of the step that synchronizes gradients"
        )


def _numel(shape: Any) -> int:
    return math.prod(int(dim) for dim in shape)
