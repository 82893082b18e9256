"""Copies (or float64 statistics) of the local pieces' tensors at the moments the hook records them."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch

from ..model import Mode, NotCapturedParam, TensorKind, TensorStats, numel_of
from .names import matches_any
from .ownership import LocalPiece
from .plain import LocalPieces, WholeRows
from .supported import screen_pieces, warn_not_captured
from .tensorstats import STATS_COLUMNS, stats_from_row, stats_rows

GRAD_KINDS = ("grad", "grad_clipped")


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off while the capture makes its few objects per piece:
    with 10^5 pieces its passes over every object alive cost a quarter of the capture, and these
    objects form no cycles to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
        pieces: LocalPieces,
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
        self.stats = StatsTable(self.pieces, norm_type)
        self.failed: set[int] = set()
        self.partial: dict[int, str | None] = {}
        """Piece index -> the group its gradients are a pending sum over (None: not partial), as read
        by the first gradient snapshot; every later one must agree."""
        self.kinds_taken: dict[TensorKind, None] = {}
        """The kinds taken so far, in the order taken (a dict as an ordered set)."""
        self.abandoned: str | None = None
        """Why nothing of this step will be written (the copies ran out of memory), else None."""
        self._keep_stats = mode == "stats"
        self._keep_values = (
            (mode == "full",) * len(self.pieces)
            if mode == "full" or not full_params
            else tuple(
                any(name is not None and matches_any(name, full_params) for name in names)
                for names in zip(self.pieces.params, self.pieces.local_names, strict=True)
            )
        )

    def take(self, kind: TensorKind, *, copy: bool = True) -> None:
        """Record `kind` ("grad", "grad_clipped", "param_before", "param_after") of every piece now.

        `copy=False` keeps a reference instead of a copy: only for a snapshot written before training
        can touch the tensors again (the one taken as the context exits). Statistics are computed
        after the loop, in batches (tensorstats.stats_rows), with one copy to the host per device."""
        self.kinds_taken.setdefault(kind, None)
        if self.values:
            self.values = {key: v for key, v in self.values.items() if key[1] != kind}
        self.stats.drop(kind)
        sparse: list[NotCapturedParam] = []
        summarize = self._keep_stats and kind in GRAD_KINDS
        positions: list[int] = []
        tensors: list[torch.Tensor] = []
        strided, failed, not_captured = torch.strided, self.failed, self.not_captured
        gradient = kind in GRAD_KINDS
        pieces, params, whole = self.pieces, self.pieces.params, self.pieces.whole
        with torch.no_grad(), collection_paused():
            # The whole rows too, one by one, when values are kept or a gradient is not dense.
            one_by_one: Sequence[int] = pieces.read_one_by_one() if whole is not None else range(len(pieces))
            if whole is not None:
                keep_any = any(self._keep_values[i] for i in whole.positions.tolist())
                if summarize and not keep_any:
                    done = self._summarize_whole(kind, whole)
                    if done is False:
                        return
                    if done is None:
                        one_by_one = range(len(pieces))
                elif keep_any or gradient:
                    one_by_one = range(len(pieces))
            for index in one_by_one:
                if (failed and index in failed) or params[index] in not_captured:
                    continue
                keep = self._keep_values[index]
                if not gradient and not keep:
                    continue
                piece = pieces[index]
                try:
                    tensor = piece.grad() if gradient else piece.value()
                    if tensor is None:
                        continue
                    reason = None
                    if tensor.layout is not strided:
                        layout = str(tensor.layout).removeprefix("torch.")
                        reason = f"sparse gradient ({layout}); gradaudit reads dense gradients"
                    if reason is None and gradient and piece.grad_partial is not None:
                        reason = self._note_partial(index, piece.grad_partial())
                    if reason is not None:
                        self._leave_out(piece.param, reason)
                        sparse.append(self.not_captured[piece.param])
                        continue
                    if keep or self.partial.get(index):
                        self.values[(index, kind)] = tensor.detach().clone() if copy else tensor.detach()
                except Exception as exc:  # noqa: BLE001  one unreadable piece must not stop the step
                    if not self._failed(piece.param, kind, exc):
                        return
                    continue
                if summarize:
                    positions.append(index)
                    tensors.append(tensor)
            if tensors and not self._summarize(kind, positions, tensors):
                return
        warn_not_captured(sparse)

    def _summarize_whole(self, kind: str, whole: WholeRows) -> bool | None:
        """Statistics of the whole rows' gradients, read as one list and reduced by the groups of one
        shape, dtype and device that inference found (no Python work per parameter beyond reading
        its `.grad`). None when a gradient is not dense: the rows are then read one by one (`take`),
        which says why; False when the step was abandoned."""
        grads = [param.grad for param in whole.tensors]
        groups = whole.groups
        skip = self._skipped(whole)
        if skip or any(g is None for g in grads):
            groups = {
                key: kept
                for key, positions in groups.items()
                if (kept := [j for j in positions if grads[j] is not None and j not in skip])
            }
        strided = torch.strided
        if any(grads[j].layout is not strided for positions in groups.values() for j in positions):  # type: ignore[union-attr]
            return None
        if groups is whole.groups:
            taken = np.arange(len(grads))
        else:
            taken = np.array([j for positions in groups.values() for j in positions], dtype=np.int64)
        if not taken.size:
            return True
        try:
            rows = stats_rows(grads, self.norm_type, groups)  # type: ignore[arg-type]  # no group holds a None
        except Exception:  # noqa: BLE001  _summarize tries again, then one tensor at a time
            return self._summarize(kind, whole.positions[taken].tolist(), [grads[j] for j in taken.tolist()])
        self.stats.put(kind, whole.positions[taken], rows[taken])
        return True

    def _skipped(self, whole: WholeRows) -> set[int]:
        """The indices among the whole rows of those that failed or whose parameter is left out."""
        skip = (
            {j for j, i in enumerate(whole.positions.tolist()) if i in self.failed} if self.failed else set()
        )
        if self.not_captured:
            skip.update(j for j, name in enumerate(whole.names) if name in self.not_captured)
        return skip

    def _summarize(self, kind: str, positions: list[int], tensors: list[torch.Tensor]) -> bool:
        """Statistics of `tensors` (of the pieces at `positions`) as one batch; when the batch fails,
        one tensor at a time, so that only the pieces that cannot be read are left out. False when
        the step was abandoned."""
        param, not_captured = self.pieces.params.__getitem__, self.not_captured
        if not_captured:
            kept = [i for i, index in enumerate(positions) if param(index) not in not_captured]
            positions, tensors = [positions[i] for i in kept], [tensors[i] for i in kept]
        try:
            self.stats.put(kind, positions, stats_rows(tensors, self.norm_type))
            return True
        except Exception as exc:  # noqa: BLE001
            if _is_out_of_memory(exc):
                return self._failed(param(positions[0]), kind, exc)
        for index, tensor in zip(positions, tensors, strict=True):
            if param(index) in not_captured:
                continue
            try:
                self.stats.put(kind, [index], stats_rows([tensor], self.norm_type))
            except Exception as exc:  # noqa: BLE001
                if not self._failed(param(index), kind, exc):
                    return False
        return True

    def _failed(self, param: str, kind: str, exc: Exception) -> bool:
        """Leave out the parameter whose tensor could not be read (False: out of memory, the step is
        abandoned)."""
        if _is_out_of_memory(exc):
            self.abandon(f"copying the tensors ran out of memory ({exc})")
            return False
        # Left out whole and said why (GA104): a piece missing from the dump would read as an
        # ownership gap, or shrink the true norm, instead.
        self.on_error(param, exc)
        self._leave_out(param, f"its {kind.replace('_', ' ')} could not be read: {exc}")
        return True

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
        for index in self.pieces.positions_of(param):
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


class StatsTable:
    """(piece index, kind) -> TensorStats of the stats mode, kept as one float64 row per piece and
    kind (tensorstats.STATS_COLUMNS): a TensorStats is built only when one is read, and the dump
    builder takes the rows as they are."""

    def __init__(self, pieces: Sequence[LocalPiece], norm_type: float) -> None:
        self.pieces = pieces
        self.norm_type = norm_type
        self.rows: dict[str, np.ndarray] = {}
        self.present: dict[str, np.ndarray] = {}
        """Per kind: which pieces have a row."""

    def put(self, kind: str, positions: Sequence[int] | np.ndarray, rows: np.ndarray) -> None:
        if kind not in self.rows:
            self.rows[kind] = np.zeros((len(self.pieces), len(STATS_COLUMNS)), dtype=np.float64)
            self.present[kind] = np.zeros(len(self.pieces), dtype=bool)
        self.rows[kind][positions] = rows
        self.present[kind][positions] = True

    def __contains__(self, key: tuple[int, str]) -> bool:
        present = self.present.get(key[1])
        return present is not None and bool(present[key[0]])

    def get(self, key: tuple[int, str]) -> TensorStats | None:
        if key not in self:
            return None
        index, kind = key
        return stats_from_row(
            self.rows[kind][index].tolist(), numel_of(self.pieces[index].local_shape), self.norm_type
        )

    def pop(self, key: tuple[int, str], default: None = None) -> None:
        if key in self:
            self.present[key[1]][key[0]] = False

    def drop(self, kind: str) -> None:
        """Forget every piece's row of `kind`."""
        if kind in self.present:
            self.present[kind][:] = False

    def clear(self) -> None:
        self.rows.clear()
        self.present.clear()
