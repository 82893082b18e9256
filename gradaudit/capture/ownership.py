"""What a capture backend reports for each local piece of a parameter (the interface between the
per-stack ownership inference and the hook that writes the dump)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import Region

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class LocalPiece:
    """One local piece of one logical parameter on this rank, as inferred from the training stack.

    `grad()` and `value()` return, at the moment they are called, this rank's gradient / parameter
    values for exactly the elements of `regions` (a plain tensor of `local_shape`, on any device), or
    None when there is none (no gradient yet).
    """

    param: str
    """Logical fully qualified name, free of wrapper prefixes (_fsdp_wrapped_module., _orig_mod., ...)."""
    global_shape: tuple[int, ...]
    """Shape of the whole logical parameter."""
    dtype: str
    """Dtype name of the local tensor ("float32", ...)."""
    regions: tuple[Region, ...]
    """The parameter's elements this piece holds, in the order of its flattened values."""
    local_shape: tuple[int, ...]
    """Shape of the tensors `grad()` and `value()` return."""
    grad: Callable[[], torch.Tensor | None]
    """This piece's gradient now, or None."""
    value: Callable[[], torch.Tensor | None]
    """This piece's parameter values now."""
    replica_group: str | None = None
    """Name of the process group over which this piece is replicated, when it is."""
    local_name: str | None = None
    """This rank's own name for the parameter, when it differs from `param` (aliases)."""
    grad_partial: Callable[[], str | None] | None = None
    """For a gradient that may be a pending partial sum (a DTensor `Partial("sum")` gradient of a
    replicated parameter): the group it sums over, as the gradient is at the moment of the call (None
    when it is not partial). The dump then records the piece as partial (`Piece.partial_group`)."""
