"""What each rank measures of a checked step, on the gradients' device and without copying them, and
the fixed-size float64 row it is written into (summed with the other ranks' in fastpath, gathered
only for a step the sum does not settle). The gradients are read as reading.GradReader reads them.
The per-piece norms come from one `torch._foreach_norm` in the gradients' own dtype (asking it for
float64 makes a float64 copy of every gradient first, 18x the time on CPU); their p-th powers are
summed per ownership group in float64. The applied coefficient is measured on a fixed sample of
elements (a few per piece, read before and after a clip call), so no second pass is made.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..norms import NORM_RTOL_BY_DTYPE
from .analysis_input import SHARDED, CallSummary, OwnershipGroup, RankSummary
from .lending import NormPass

if TYPE_CHECKING:
    from ..capture.arguments import CallRecord
    from ..capture.ownership import LocalPiece
    from ..model import Topology

MAX_CALLS = 4
"""Clip calls per step whose numbers travel; later ones are counted, and overwrite the last slot."""
SAMPLE_PIECES = 16
"""The largest pieces of a rank each give SAMPLE_PER_PIECE elements to the coefficient's sample."""
SAMPLE_PER_PIECE = 8
_GRAD = operator.attrgetter("grad")
_NONES = itertools.repeat(None)
NONFINITE_SLOTS = 4
"""Pieces whose gradient was nonfinite before the step's first clip call, named by their index in the
rank's ownership (every rank knows every rank's, from attaching): the row's last numbers."""

OK, FAILED, OFF, SKIP = 1.0, -1.0, -2.0, -3.0
"""A rank's status in its vector: measured; could not measure the step; its guard leaves (removed or
switched off: every rank switches off with it); took part without measuring (paused, or the step is
captured in full)."""
HEADER = 10
"""status, clip calls, applied coefficient, loss scale, unscaled before clipping, step skipped, the
gradients' loosest dtype (its index in GRAD_DTYPES), and the stamp every rank must agree on: the guard's
step, the training forward passes seen since the guard was attached, and whether this rank's parameters
changed since ownership was inferred."""
STEP, CLOCK, CHANGED = 7, 8, 9
GRAD_DTYPES = tuple(NORM_RTOL_BY_DTYPE)


@dataclass(frozen=True, kw_only=True)
class VectorLayout:
    """Where each number of a rank's summary lies in the gathered vector (the same on every rank)."""

    num_groups: int
    max_calls: int = MAX_CALLS

    @property
    def call_size(self) -> int:
        return 4 + self.num_groups

    @property
    def size(self) -> int:
        return self.weights_offset + self.num_groups

    @property
    def weights_offset(self) -> int:
        """Per group, sum w^2 of this rank's copy of the weights after the optimizer step (on a weight
        check's step; nan on the others)."""
        return self.nonfinite_offset + NONFINITE_SLOTS

    @property
    def nonfinite_offset(self) -> int:
        return HEADER + 3 * self.num_groups + self.max_calls * self.call_size

    def call_offset(self, call: int) -> int:
        return HEADER + 3 * self.num_groups + call * self.call_size

    def unpack_rows(
        self, rows: np.ndarray, *, held: Sequence[tuple[bool, ...]], topologies: Sequence[Topology]
    ) -> dict[int, RankSummary]:
        """Every rank's summary from the gathered matrix (every status OK; rank k's row k), read a
        column at a time (a failing step unpacks every rank's)."""
        rows = np.asarray(rows, dtype=np.float64)
        g, h, n = self.num_groups, HEADER, rows.shape[0]
        counted = rows[:, [1, *range(h + g, h + 3 * g)]]
        if not (np.abs(counted) < 2.0**53).all():
            raise ValueError("a rank's row holds a count that is not an integer")
        num_calls = rows[:, 1].astype(np.int64).tolist()
        slots = [self._calls_at(rows, k) for k in range(min(max(num_calls, default=0), self.max_calls))]
        calls = [
            tuple(slot[r] for slot in slots[: max(0, min(c, self.max_calls))])
            for r, c in enumerate(num_calls)
        ]
        dtype = rows[:, 6]
        return {
            rank: RankSummary(
                rank=rank,
                terms=terms,
                held=held[rank],
                num_nan=num_nan,
                num_inf=num_inf,
                applied_coef=applied_coef,
                loss_scale=loss_scale,
                unscaled=unscaled,
                skipped=skipped,
                grad_dtype=grad_dtype,
                calls=calls[rank],
                num_calls=num_calls[rank],
                topology=topologies[rank],
            )
            for rank, terms, num_nan, num_inf, applied_coef, loss_scale, unscaled, skipped, grad_dtype in zip(
                range(n),
                _tuples(rows[:, h : h + g]),
                _tuples(rows[:, h + g : h + 2 * g].astype(np.int64)),
                _tuples(rows[:, h + 2 * g : h + 3 * g].astype(np.int64)),
                _numbers(rows[:, 2]),
                _numbers(rows[:, 3]),
                _flags(rows[:, 4]),
                _flags(rows[:, 5]),
                [None] * n
                if np.isnan(dtype).all()
                else [None if math.isnan(x) else GRAD_DTYPES[int(x)] for x in dtype.tolist()],
                strict=True,
            )
        }

    def _calls_at(self, rows: np.ndarray, call: int) -> list[CallSummary]:
        """Every rank's CallSummary of its call slot `call` (read only where the rank made that call)."""
        at, g = self.call_offset(call), self.num_groups
        return [
            CallSummary(
                reported_norm=reported, max_norm=max_norm, norm_type=norm_type, coef=coef, terms=terms
            )
            for reported, max_norm, norm_type, coef, terms in zip(
                *(_numbers(rows[:, at + i]) for i in range(4)),
                _tuples(rows[:, at + 4 : at + 4 + g]),
                strict=True,
            )
        ]


def _tuples(block: np.ndarray) -> list[tuple[Any, ...]]:
    """Each row of a [n, k] block as a tuple of Python numbers."""
    if not block.shape[1]:
        none: list[tuple[Any, ...]] = [()] * block.shape[0]
        return none
    return list(zip(*(block[:, i].tolist() for i in range(block.shape[1])), strict=True))


def _numbers(column: np.ndarray) -> list[float | None]:
    """Each value as a Python float, None for a nan."""
    values = column.tolist()
    return [None if math.isnan(v) else v for v in values] if (column != column).any() else values


def _flags(column: np.ndarray) -> list[bool | None]:
    """Each value as a bool, None for a nan."""
    return [None if math.isnan(v) else bool(v) for v in column.tolist()]


def group_key(piece: LocalPiece) -> str:
    """The ownership group of a piece: the process group it is replicated over, or sharded."""
    return piece.replica_group if piece.replica_group is not None else SHARDED


def ownership_groups(keys: Sequence[str], dtype_of: dict[str, str]) -> tuple[OwnershipGroup, ...]:
    """The groups of the union of every rank's group keys, in a fixed order."""
    return tuple(
        OwnershipGroup(
            name=key,
            replica_group=None if key == SHARDED else key,
            dtype=dtype_of.get(key, "float32"),
        )
        for key in sorted(set(keys))
    )


class LocalSummary:
    """This rank's measurements of its pieces, as device tensors (nothing here waits for the device)."""

    def __init__(
        self,
        pieces: Sequence[LocalPiece],
        group_index: Sequence[int],
        layout: VectorLayout,
        norm_type: float,
        *,
        model: torch.nn.Module | None = None,
        replicated: Sequence[int] = (),
    ) -> None:
        from .reading import GradReader

        self.pieces = tuple(pieces)
        self.reader = GradReader(self.pieces, model)
        self.reader.replicated(self.pieces, [i for i, g in enumerate(group_index) if g in set(replicated)])
        self._readers = self.reader.readers
        self.group_index = tuple(group_index)
        self.layout = layout
        self.norm_type = norm_type
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        self.last_norms: tuple[torch.Tensor, tuple[int, ...]] | None = None
        """The per-piece norms of the latest measuring and the pieces they are of (on the device)."""
        self.lendable: NormPass | None = None
        """The norm pass of the latest `measure`, for the clip call it comes before (see lending.py)."""
        largest = sorted(range(len(self.pieces)), key=lambda i: (-math.prod(self.pieces[i].local_shape), i))
        self._sampled = tuple(i for i in largest if math.prod(self.pieces[i].local_shape) > 0)[:SAMPLE_PIECES]
        position = {piece: k for k, piece in enumerate(self.reader.order)}
        self._sampled_at = operator.itemgetter(*(position[i] for i in self._sampled), 0)
        """Where `read` gives the sampled pieces' gradients when every piece has one (and one more, so
        that it always gives a tuple)."""
        self._sampled_grads = _grads_getter([self._readers[i] for i in self._sampled])
        """The sampled pieces' gradients now, read in one C-level map when they are whole parameters."""

    def _grads(self) -> tuple[list[torch.Tensor], tuple[int, ...]]:
        return self.reader.read()  # gradients that require grad (create_graph) are measured under no_grad

    def measure(self) -> tuple[torch.Tensor | None, Any, Sampled]:
        """This rank's group terms now (see `terms`), the sample (see `sample`) of the gradients read
        with them, and its elements as views of those gradients (a clip in place shows in them). The
        norm pass is kept in `lendable` for the clip call that follows (see lending.py)."""
        with torch.no_grad():
            return self._measure()

    def _measure(self) -> tuple[torch.Tensor | None, Any, Sampled]:
        grads, present = self._grads()
        if present is self.reader.order and self._sampled:  # every piece has a gradient
            pieces, tensors = self._sampled, self._sampled_at(grads)[:-1]
        else:
            by_piece = dict(zip(present, grads, strict=True))
            pieces = tuple(i for i in self._sampled if i in by_piece)
            tensors = tuple(by_piece[i] for i in pieces)
        views = strided_views(tensors, SAMPLE_PER_PIECE)
        sampled = tuple(zip(pieces, views, strict=True))
        if not all(map(operator.is_not, views, _NONES)):
            sampled = tuple((i, view) for i, view in sampled if view is not None)
        # the sample first, while the gradients just read are in the caches the norm pass then sweeps
        sample = float64_cat([view for _, view in sampled])
        return self._terms(grads, present, lendable=True), sample, sampled

    def terms(self) -> torch.Tensor | None:
        """[terms per group, pieces with a nan per group, pieces with an inf per group] in float64, on
        the gradients' device; None when no piece has a gradient."""
        with torch.no_grad():
            return self._terms(*self._grads())

    def _terms(
        self, grads: list[torch.Tensor], present: tuple[int, ...], *, lendable: bool = False
    ) -> torch.Tensor | None:

        if not grads:
            return None
        device = grads[0].device
        per_piece = torch._foreach_norm(grads, self.norm_type)
        stacked = torch.stack(per_piece)
        if lendable:
            self.lendable = NormPass(grads, self.norm_type, per_piece, stacked)
        self.last_norms = (stacked, present)
        key = () if present is self.reader.order else present  # every piece: no hash of the tuple
        index = self._index_cache.get(key)
        if index is None:
            index = torch.tensor([self.group_index[i] for i in present], dtype=torch.int64, device=device)
            self._index_cache[key] = index
        if device.type == "cpu" and not math.isinf(self.norm_type):
            # on the host the norms are read at no cost and summed per group by numpy (no tensor op per
            # number); the pieces with a nan or an inf are counted only when the total is not finite

            g, at = self.layout.num_groups, index.numpy()
            on_host = stacked.float() if stacked.dtype == torch.bfloat16 else stacked  # numpy has no bfloat16
            # the terms, then zeros where the nonfinite counts go (the indices are below g)
            summed = np.bincount(
                at, weights=on_host.numpy().astype(np.float64) ** self.norm_type, minlength=3 * g
            )
            if math.isfinite(summed.sum()):
                return torch.from_numpy(summed)
        norms = stacked.to(torch.float64)
        out = torch.zeros((3, self.layout.num_groups), dtype=torch.float64, device=device)
        finite = norms.nan_to_num(0.0, 0.0, 0.0)
        power = finite if math.isinf(self.norm_type) else finite.pow(self.norm_type)
        # [p-th powers, nan flags, inf flags] of the pieces, summed per group in one op (stack promotes)
        columns = torch.stack((power, norms.isnan(), norms.isinf()))
        out.index_add_(1, index, columns)
        if math.isinf(self.norm_type):
            out[0].zero_().scatter_reduce_(0, index, finite, "amax")  # the largest norm per group
        return out.reshape(-1)  # [terms per group, nan pieces per group, inf pieces per group]

    def nonfinite_pieces(self, norms: tuple[torch.Tensor, tuple[int, ...]]) -> torch.Tensor:
        """The indices (float64, nan-padded) of the first NONFINITE_SLOTS pieces whose norm in `norms` is
        not finite, found on the norms' device without reading them back."""
        values, present = norms
        order = self._index_cache.get((-1,) + present)
        if order is None:
            # a weight per piece that is highest for the first one: topk of the nonfinite picks the first
            count = len(present)
            order = torch.tensor(
                [[float(count - k) for k in range(count)], [float(i) for i in present]],
                dtype=torch.float64,
                device=values.device,
            )
            self._index_cache[(-1,) + present] = order
        k = min(NONFINITE_SLOTS, len(present))
        weights, at = torch.topk((~values.isfinite()).to(torch.float64) * order[0], k)
        found = torch.where(weights > 0, order[1][at], math.nan)
        return torch.cat((found, found.new_full((NONFINITE_SLOTS - k,), math.nan)))

    def weight_terms(self) -> torch.Tensor | None:
        """Per group, sum w^2 of the replicated pieces' weights now (float64, on their device; 0 for
        the groups no replica holds): one fused norm pass over those pieces only."""
        weights, present = self.reader.read_weights()
        if not weights:
            return None
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm(weights, 2.0)).to(torch.float64)
            index = torch.tensor(
                [self.group_index[i] for i in present], dtype=torch.int64, device=norms.device
            )
            out = torch.zeros(self.layout.num_groups, dtype=torch.float64, device=norms.device)
            return out.index_add_(0, index, norms.square())

    def has_gradients(self) -> bool:
        """Whether any of the sampled pieces (the largest) holds a gradient now."""
        return any(self._readers[i]() is not None for i in self._sampled)

    def sample(self, sampled: Sampled | None = None) -> Any:
        """A fixed sample of this rank's gradient elements (float64, a few per large piece), from the
        views `measure` took (the gradients are clipped in place, so they show the clip), or read now."""
        if sampled is None:
            return strided_sample(
                [g for i in self._sampled if (g := self._readers[i]()) is not None], SAMPLE_PER_PIECE
            )
        # a gradient freed since it was read (ZeRO frees its partitions inside the step) gives none
        if len(sampled) == len(self._sampled) and all(map(operator.is_not, self._sampled_grads(), _NONES)):
            return float64_cat([view for _, view in sampled])
        return float64_cat([view for i, view in sampled if self._readers[i]() is not None])


def strided_views(tensors: Sequence[torch.Tensor], per_tensor: int) -> list[Any]:
    """Per tensor, `per_tensor` evenly spaced elements as one strided view (None: not contiguous). On the
    host they are numpy views of the same memory, so that the few numbers are read after the model's
    step without a tensor op each (see float64_cat); tensor views where numpy cannot see the memory
    (a device, bfloat16, gradients that require grad)."""
    try:
        return _views(tensors, per_tensor, as_numpy=True)
    except (TypeError, RuntimeError):
        return _views(tensors, per_tensor, as_numpy=False)


def _views(tensors: Sequence[torch.Tensor], per_tensor: int, *, as_numpy: bool) -> list[Any]:
    if as_numpy:
        return [
            tensor.numpy().ravel()[_spacing(tensor.numel(), per_tensor)[2]]
            if tensor.is_contiguous()
            else None
            for tensor in tensors
        ]
    views: list[Any] = []
    for tensor in tensors:
        if not tensor.is_contiguous():
            views.append(None)
            continue
        count, stride, _ = _spacing(tensor.numel(), per_tensor)
        # evenly spaced elements as one strided view (a third cheaper than index_select)
        views.append(tensor.as_strided((count,), (stride,), tensor.storage_offset()))
    return views


@functools.lru_cache(maxsize=1024)
def _spacing(numel: int, per_tensor: int) -> tuple[int, int, slice]:
    """Of a tensor of `numel` elements: how many the sample takes, their stride, and the slice of them."""
    count = min(per_tensor, numel)
    stride = max(1, (numel - 1) // (count - 1)) if count > 1 else 1
    return count, stride, slice(0, stride * (count - 1) + 1, stride)


def _grads_getter(readers: Sequence[Callable[[], Any]]) -> Callable[[], list[Any]]:
    """What reads these readers' gradients: one map of `.grad` when each reads a whole parameter's
    (reading.whole_param), else each reader."""
    from .reading import whole_param

    params = [whole_param(reader) for reader in readers]
    if all(param is not None for param in params):
        return lambda: list(map(_GRAD, params))
    return lambda: [read() for read in readers]


def strided_sample(tensors: Sequence[torch.Tensor], per_tensor: int) -> Any:
    """`per_tensor` evenly spaced elements of each contiguous tensor, as one float64 copy (None: none)."""
    return float64_cat([view for view in strided_views(tensors, per_tensor) if view is not None])


def float64_cat(views: list[Any]) -> Any:
    """The views' elements as one float64 copy: a numpy array of numpy views, else a tensor."""
    if not views:
        return None
    if not isinstance(views[0], torch.Tensor):
        return np.concatenate(views, dtype=np.float64)
    return torch.cat(views).to(torch.float64)  # cat promotes mixed dtypes to the widest, exactly


Sampled = tuple[tuple[int, Any], ...]
"""(piece index, a strided view of its sampled elements: numpy on the host, see strided_views) of the sampled pieces, as read at one moment."""


def coefficient(before: Any, after: Any) -> torch.Tensor | float:
    """The least-squares factor between two samples of the same elements (nan when unknown): numpy
    arrays on the host (two dots, no tensor op), else tensors on their device."""
    if before is None or after is None or before.shape != after.shape:
        return math.nan
    if not isinstance(before, torch.Tensor) or before.device.type == "cpu":
        b, a = (x.numpy() if isinstance(x, torch.Tensor) else x for x in (before, after))
        squared = float(b.dot(b))  # dot, not @: the same sum, without matmul's dispatch
        return float(a.dot(b)) / squared if squared > 0 else math.nan
    denominator = torch.dot(before, before)
    return torch.where(denominator > 0, torch.dot(after, before) / denominator, math.nan)


def pack(
    layout: VectorLayout,
    *,
    device: Any,
    terms: Any,
    applied_coef: Any,
    calls: Sequence[CallRecord],
    num_calls: int,
    scaler: tuple[Any, bool | None, bool | None] = (None, None, None),
    grad_dtype: str | None = None,
) -> torch.Tensor:
    """This rank's vector: on a device, device tensors are copied in there (no host sync); on the host
    it is written as one numpy array (a few numbers read at no cost, no tensor op per number)."""
    if torch.device(device).type == "cpu":
        host = np.full(layout.size, math.nan)
        _fill(host, layout, terms, applied_coef, calls, num_calls, scaler, grad_dtype, _put_host)
        return torch.from_numpy(host)
    vector = torch.full((layout.size,), math.nan, dtype=torch.float64, device=device)
    _fill(vector, layout, terms, applied_coef, calls, num_calls, scaler, grad_dtype, _put)
    return vector


def _fill(
    vector: Any,
    layout: VectorLayout,
    terms: Any,
    applied_coef: Any,
    calls: Sequence[CallRecord],
    num_calls: int,
    scaler: tuple[Any, bool | None, bool | None],
    grad_dtype: str | None,
    put: Callable[[Any, Any, Any], None],
) -> None:
    g = layout.num_groups
    vector[0] = OK
    vector[1] = float(num_calls)
    put(vector, 2, applied_coef)
    for at, value in enumerate(scaler, start=3):  # loss scale, unscaled, skipped (a bool is 1.0 or 0.0)
        put(vector, at, value)
    if grad_dtype in GRAD_DTYPES:
        vector[6] = float(GRAD_DTYPES.index(grad_dtype))
    put(vector, slice(HEADER, HEADER + 3 * g), terms)
    for k, call in enumerate(calls[: layout.max_calls]):
        at = layout.call_offset(k)
        put(vector, at, call.reported)
        put(vector, at + 1, call.max_norm)
        put(vector, at + 2, call.norm_type)
        put(vector, at + 3, call.coef)
        put(vector, slice(at + 4, at + 4 + g), None if call.terms is None else call.terms[:g])


def status_vector(layout: VectorLayout, status: float, device: Any = "cpu") -> torch.Tensor:
    """The vector of a rank that takes part without measurements (FAILED, OFF or SKIP)."""
    if getattr(device, "type", device) == "cpu":  # written as numpy: no tensor op per number
        host = np.full(layout.size, math.nan)
        host[0] = status
        return torch.from_numpy(host)
    vector = torch.full((layout.size,), math.nan, dtype=torch.float64, device=device)
    vector[0] = status
    return vector


def stamped(vector: torch.Tensor, *, step: int, clock: int, changed: bool) -> torch.Tensor:
    """`vector` with the stamp every rank compares before judging (see HEADER)."""
    target = vector.numpy() if vector.device.type == "cpu" else vector  # a host vector: no tensor op
    target[STEP], target[CLOCK], target[CHANGED] = float(step), float(clock), float(changed)
    return vector


def _put(vector: torch.Tensor, at: int | slice, value: Any) -> None:
    """Write `value` (a tensor, a number, or None) at `at` on the vector's device; a span with no
    value is zero (no terms: nothing measured)."""
    if isinstance(at, slice):
        vector[at].copy_(value) if value is not None else vector[at].zero_()
        return
    if value is None:
        return
    if isinstance(value, torch.Tensor):
        vector[at : at + 1].copy_(value.detach().reshape(-1)[:1])
    else:
        try:
            vector[at] = float(value)
        except (TypeError, ValueError):
            return


def _put_host(vector: np.ndarray, at: int | slice, value: Any) -> None:
    """`_put` on the host's numpy array: a host tensor's numbers are read as they are."""
    if isinstance(at, slice):
        vector[at] = 0.0 if value is None else _host_numbers(value)
        return
    if value is None:
        return
    try:
        vector[at] = float(value)  # a number, or a tensor of one element
    except (TypeError, ValueError, RuntimeError):
        with contextlib.suppress(AttributeError, IndexError, TypeError, ValueError, RuntimeError):
            vector[at] = value.detach().reshape(-1)[0].item()  # a tensor of several: its first


def _host_numbers(value: Any) -> Any:
    """A host tensor's numbers as numpy reads them (no copy where it can), else `value` itself."""
    if not isinstance(value, torch.Tensor):
        return value
    try:
        return value.numpy()
    except (TypeError, RuntimeError):  # it requires grad, or numpy has not its dtype (bfloat16)
        return value.detach().to(torch.float64).numpy()
