"""Copies (or float64 statistics) of the local pieces' tensors at the moments the hook records them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..model import Mode, NotCapturedParam, TensorKind, TensorStats
from .names import matches_any
from .ownership import LocalPiece
from .supported import screen_pieces, sparse_reason, warn_not_captured

if TYPE_CHECKING:
    import torch

GRAD_KINDS = ("grad", "grad_clipped")


class Snapshots:
    """Per (piece index, tensor kind): a detached copy kept on the tensor's device, and/or its TensorStats.

    Full mode keeps values. Stats mode keeps TensorStats of every piece's gradients, computed where
    the tensor lives, and the values (gradients and parameters) of pieces whose logical or local name
    matches one of `full_params` (glob patterns). Parameters are not summarized in stats mode: the
    update norm needs their difference, which two summaries cannot give, and summing them would
    double the cost of a stats dump. A piece whose tensor cannot be read is
    reported to `on_error` and dropped from the dump (the checker then sees a gap, never a wrong value).
    """

    def __init__(
        self,
        pieces: Sequence[LocalPiece],
        *,
        mode: Mode,
        norm_type: float,
        full_params: Sequence[str],
        on_error: Callable[[str, Exception], None],
        left_out: Sequence[NotCapturedParam] = (),
    ) -> None:
        self.pieces, screened_out = screen_pieces(pieces, norm_type)
        self.not_captured: dict[str, NotCapturedParam] = {p.name: p for p in (*left_out, *screened_out)}
        """Parameters left out, by name: given (ownership inference refused them), screened out here,
        or found holding a sparse gradient."""
        self.norm_type = norm_type
        self.on_error = on_error
        self.values: dict[tuple[int, TensorKind], torch.Tensor] = {}
        self.stats: dict[tuple[int, TensorKind], TensorStats] = {}
        self.failed: set[int] = set()
        self.partial: dict[int, str | None] = {}
        """Piece index -> the group its gradients are a pending sum over (None: not partial), as read
        by the first gradient snapshot; every later one must agree."""
        self.kinds_taken: dict[TensorKind, None] = {}
        """The kinds taken so far, in the order taken (a dict as an ordered set)."""
        self.abandoned: str | None = None
        """Why nothing of this step will be written (the copies ran out of memory), else None."""
        self._keep_stats = mode == "stats"
        self._keep_values = tuple(
            mode == "full"
            or matches_any(p.param, full_params)
            or (p.local_name is not None and matches_any(p.local_name, full_params))
            for p in self.pieces
        )

    def take(self, kind: TensorKind, *, copy: bool = True) -> None:
        """Record `kind` ("grad", "grad_clipped", "param_before", "param_after") of every piece now.

        `copy=False` keeps a reference instead of a copy: only for a snapshot written before training
        can touch the tensors again (the one taken as the context exits)."""
        import torch

        from .tensorstats import stats_of_tensor

        self.kinds_taken.setdefault(kind, None)
        sparse: list[NotCapturedParam] = []
        with torch.no_grad():
            for index, piece in enumerate(self.pieces):
                if index in self.failed or piece.param in self.not_captured:
                    continue
                if kind not in GRAD_KINDS and not self._keep_values[index]:
                    continue
                try:
                    tensor = piece.grad() if kind in GRAD_KINDS else piece.value()
                    self.values.pop((index, kind), None)
                    self.stats.pop((index, kind), None)
                    if tensor is None:
                        continue
                    reason = sparse_reason(tensor)
                    if reason is None and kind in GRAD_KINDS and piece.grad_partial is not None:
                        reason = self._note_partial(index, piece.grad_partial())
                    if reason is not None:
                        self._leave_out(piece.param, reason)
                        sparse.append(self.not_captured[piece.param])
                        continue
                    if self._keep_values[index] or self.partial.get(index):
                        self.values[(index, kind)] = tensor.detach().clone() if copy else tensor.detach()
                    if self._keep_stats and kind in GRAD_KINDS:
                        self.stats[(index, kind)] = stats_of_tensor(tensor, self.norm_type)
                except Exception as exc:  # noqa: BLE001  one unreadable piece must not stop the step
                    if _is_out_of_memory(exc):
                        self.abandon(f"copying the tensors ran out of memory ({exc})")
                        return
                    # Left out whole and said why (GA104): a piece missing from the dump would read as
                    # an ownership gap, or shrink the true norm, instead.
                    self.on_error(piece.param, exc)
                    self._leave_out(piece.param, f"its {kind.replace('_', ' ')} could not be read: {exc}")
        warn_not_captured(sparse)

    def _note_partial(self, index: int, group: str | None) -> str | None:
        """Record whether piece `index`'s gradient is a pending partial sum; the reason to leave its
        parameter out when it changed between snapshots (a sum reduced in between, in place)."""
        if index not in self.partial:
            self.partial[index] = group
            return None
        before = self.partial[index]
        if before == group:
            return None

        def what(partial: str | None) -> str:
            return "a reduced gradient" if partial is None else f"a partial sum over {partial}"

        return (
            f"its gradient was {what(before)} before clipping and {what(group)} after; gradaudit cannot "
            "tell which sum each holds"
        )

    def _leave_out(self, param: str, reason: str) -> None:
        """Forget whatever was taken of `param`'s pieces: a parameter is captured whole or not at all."""
        self.not_captured[param] = NotCapturedParam(name=param, reason=reason)
        for index, piece in enumerate(self.pieces):
            if piece.param == param:
                for kind in list(self.kinds_taken):
                    self.values.pop((index, kind), None)
                    self.stats.pop((index, kind), None)

    def abandon(self, reason: str) -> None:
        """Give every copy back at once (the training step needs the memory more than the dump)."""
        self.abandoned = reason
        self.values.clear()
        self.stats.clear()
        self.failed.update(range(len(self.pieces)))

    def has(self, kind: TensorKind) -> bool:
        return kind in self.kinds_taken

    def kinds_of(self, index: int) -> list[TensorKind]:
        """The kinds held for piece `index`, in the order they were first taken (a look-up per kind
        taken, not a scan of every snapshot: a rank may hold 10^5 pieces)."""
        return [k for k in self.kinds_taken if (index, k) in self.values or (index, k) in self.stats]


def _is_out_of_memory(exc: Exception) -> bool:
    return type(exc).__name__ == "OutOfMemoryError" or "out of memory" in str(exc).lower()
