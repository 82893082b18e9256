"""Which local pieces the dump can hold: complex gradients as real pairs, the rest left out with a reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from ..model import FLOAT_DTYPES, Box, FlatRange, NotCapturedParam, Region
from ..warn import warn_once
from .ownership import LocalPiece
from .plain import LocalPieces

REAL_OF_COMPLEX = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


def screen_pieces(pieces: LocalPieces, norm_type: float) -> tuple[LocalPieces, tuple[NotCapturedParam, ...]]:
    """The pieces to capture, and the parameters left out (warned about once, by name).

    torch's clip_grad_norm_ takes the modulus of a complex gradient, so for the 2-norm its norm is the
    norm of torch.view_as_real(grad): such a piece is captured as that real view, with a trailing
    dimension of 2 added to its parameter's shape. Other norms of a complex gradient are no norm of
    its real parts, and other dtypes are none the reader knows: those parameters are left out. (Whole
    rows are float: inference took no other dtype into them.)"""
    changes: dict[int, LocalPiece | None] = {}
    left_out: dict[str, str] = {}
    dtypes = pieces.dtypes
    for index in pieces.read_one_by_one():
        dtype = dtypes[index]
        if dtype in FLOAT_DTYPES:
            continue
        piece = pieces[index]
        if dtype in REAL_OF_COMPLEX and norm_type == 2.0:
            changes[index] = _as_real_pairs(piece)
            continue
        changes[index] = None
        reason = (
            f"complex gradient ({dtype}) under norm_type {norm_type:g}: only its 2-norm is the "
            "norm of its real and imaginary parts"
            if dtype in REAL_OF_COMPLEX
            else f"dtype {dtype}, which the dump format cannot hold"
        )
        left_out.setdefault(piece.param, reason)
    not_captured = tuple(NotCapturedParam(name=n, reason=r) for n, r in left_out.items())
    warn_not_captured(not_captured)
    return pieces.edited(changes), not_captured


def warn_not_captured(params: Sequence[NotCapturedParam]) -> None:
    if not params:
        return
    named = "; ".join(f"{p.name!r}: {p.reason}" for p in params[:10])
    more = f" (and {len(params) - 10} more)" if len(params) > 10 else ""
    warn_once(
        "not_captured:" + ",".join(p.name for p in params),
        f"gradaudit: not capturing {len(params)} parameter(s), listed as not checked in the report: "
        f"{named}{more}",
    )


def _as_real_pairs(piece: LocalPiece) -> LocalPiece:
    return dataclasses.replace(
        piece,
        global_shape=(*piece.global_shape, 2),
        dtype=REAL_OF_COMPLEX[piece.dtype],
        regions=tuple(_with_pairs(r) for r in piece.regions),
        local_shape=(*piece.local_shape, 2),
        grad=_real_view(piece.grad),
        value=_real_view(piece.value),
    )


def _with_pairs(region: Region) -> Region:
    if isinstance(region, Box):
        return Box(offsets=(*region.offsets, 0), shape=(*region.shape, 2))
    assert isinstance(region, FlatRange)
    return FlatRange(start=2 * region.start, stop=2 * region.stop)


def _real_view(read: Callable[[], torch.Tensor | None]) -> Callable[[], torch.Tensor | None]:
    def real() -> torch.Tensor | None:
        tensor = read()
        return None if tensor is None else torch.view_as_real(tensor.resolve_conj())

    return real
