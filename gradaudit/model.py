"""The in-memory description of a dumped step: frozen values, no I/O, no torch."""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args, overload

import numpy as np

TensorKind = Literal["grad", "grad_clipped", "param_before", "param_after"]
"""What a dumped tensor is: the gradient before clipping, after clipping, the parameter
before and after the optimizer step (the strings are the file format's)."""

TENSOR_KINDS: tuple[TensorKind, ...] = get_args(TensorKind)

Mode = Literal["full", "stats"]
"""What a dump holds: "full" tensor values, or "stats" float64 statistics only."""

MODES: tuple[Mode, ...] = get_args(Mode)

_KIND_SET = frozenset(TENSOR_KINDS)

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def _dims_valid(values: tuple[int, ...]) -> bool:
    for v in values:  # the common case first: plain non-negative ints (pieces are validated by the million)
        if type(v) is not int or v < 0:
            return not any((not isinstance(v, int)) or isinstance(v, bool) or v < 0 for v in values)
    return True


def _check_dims(name: str, values: tuple[int, ...]) -> None:
    if not _dims_valid(values):
        raise ValueError(f"{name} must be non-negative integers, got {values!r}")


def numel_of(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class Box:
    """An N-D block of a parameter: `param[o0:o0+s0, o1:o1+s1, ...]` (DTensor Shard, tensor parallel)."""

    offsets: tuple[int, ...]
    """First index of the block along each dim of the parameter."""
    shape: tuple[int, ...]
    """Extent of the block along each dim (its elements are `numel`)."""

    def __post_init__(self) -> None:
        _check_dims("box offsets", self.offsets)
        _check_dims("box shape", self.shape)
        if len(self.offsets) != len(self.shape):
            raise ValueError(
                f"box offsets {self.offsets} and shape {self.shape} differ in rank; give one offset per dim"
            )

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    def fits_in(self, global_shape: tuple[int, ...]) -> bool:
        return len(global_shape) == len(self.shape) and all(
            o + s <= g for o, s, g in zip(self.offsets, self.shape, global_shape, strict=False)
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class FlatRange:
    """Elements `[start, stop)` of the row-major flattened parameter (FSDP1 FlatParameter shards, ZeRO)."""

    start: int
    """First element, counted in the row-major flattened parameter."""
    stop: int
    """One past the last element (exclusive)."""

    def __post_init__(self) -> None:
        _check_dims("flat range", (self.start, self.stop))
        if self.stop < self.start:
            raise ValueError(f"flat range stop {self.stop} is before start {self.start}")

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def fits_in(self, global_shape: tuple[int, ...]) -> bool:
        return self.stop <= numel_of(global_shape)


Region = Box | FlatRange


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorStats:
    """Summary of one dumped tensor, in float64, enough for norms and agreement checks without values.

    `sum_pow` is sum(|x|^norm_type) over finite elements for the run's norm type; `sum_sq` is the same
    for p=2. `fingerprint` is a fixed random-like projection of the values: replicas agree on it.
    """

    numel: int
    """Elements summarized, finite or not."""
    norm_type: float
    """The `p` that `sum_pow` was taken for (inf: `sum_pow` is the max |x|)."""
    sum_pow: float
    """sum(|x|^norm_type) over the finite elements."""
    sum_sq: float
    """sum(x^2) over the finite elements (the 2-norm, whatever the run's p)."""
    max_abs: float
    """max |x| over the finite elements (0 when there are none)."""
    num_nan: int = 0
    """Elements that are NaN."""
    num_posinf: int = 0
    """Elements that are +inf."""
    num_neginf: int = 0
    """Elements that are -inf."""
    fingerprint: tuple[float, ...] = ()
    """Projections of the values on fixed pseudo-random vectors; () when not taken."""

    @property
    def num_nonfinite(self) -> int:
        return self.num_nan + self.num_posinf + self.num_neginf


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamInfo:
    """A logical parameter as the whole model sees it."""

    name: str
    """The logical name, as the unwrapped model names the parameter."""
    global_shape: tuple[int, ...]
    """Shape of the whole parameter, before any sharding."""
    dtype: str
    """Dtype name of the parameter ("float32", "bfloat16", ...)."""

    def __post_init__(self) -> None:
        if not _dims_valid(self.global_shape):
            _check_dims(f"global shape of {self.name!r}", self.global_shape)

    @property
    def numel(self) -> int:
        return numel_of(self.global_shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class Piece:
    """One local piece of a logical parameter on one rank.

    The piece's values, flattened row-major, are the concatenation of its regions' elements in order.
    `tensors` maps a tensor kind (see TENSOR_KINDS) to its key in the safetensors file; `stats` holds
    precomputed summaries (stats-only dumps, or kinds dumped without values).
    """

    index: int
    """Position of the piece in its rank's file, from 0."""
    param: str
    """The logical parameter (a `ParamInfo.name`) this piece is part of."""
    regions: tuple[Region, ...]
    """The parameter's elements this piece holds, in the order of its flattened values."""
    local_shape: tuple[int, ...]
    """Shape of the tensor this rank holds."""
    dtype: str
    """Dtype name of the dumped values."""
    local_name: str | None = None
    """This rank's own name for the parameter, when it differs from `param`."""
    replica_group: str | None = None
    """The process group over which this piece is replicated; None when no one holds a copy."""
    tensors: Mapping[TensorKind, str] = field(default_factory=dict)
    """Tensor kind -> its key in the rank's safetensors file (kinds dumped with values)."""
    stats: Mapping[TensorKind, TensorStats] = field(default_factory=dict)
    """Tensor kind -> float64 statistics, for kinds dumped without values."""
    call_stats: tuple[TensorStats, ...] = ()
    """When the step made two or more clip calls: statistics of this piece's gradient just before each
    call, in call order (one per `ClipRecord.calls` entry; an absent gradient as zeros). Else empty."""
    partial_group: str | None = None
    """When the gradients are a pending partial sum (a DTensor `Partial("sum")` gradient of a
    replicated parameter, as under sequence parallel): the group over which they sum. The gradient of
    the piece's elements is the sum of the pieces of this layout on the ranks of this rank's list in
    that group; each piece alone is no part of any norm."""

    def __post_init__(self) -> None:
        if self.call_stats:
            for stats in self.call_stats:
                if stats.numel != numel_of(self.local_shape):
                    raise ValueError(
                        f"piece of {self.param!r}: call statistics of {stats.numel} elements for a piece of "
                        f"{numel_of(self.local_shape)}; give one TensorStats of the whole piece per clip call"
                    )
        if not _dims_valid(self.local_shape):
            _check_dims(f"local shape of {self.param!r}", self.local_shape)
        covered = sum([r.numel for r in self.regions])
        if covered != numel_of(self.local_shape):
            raise ValueError(
                f"piece of {self.param!r}: regions cover {covered} elements but the local shape "
                f"{self.local_shape} has {numel_of(self.local_shape)}; make the regions match the tensor"
            )
        if not (_KIND_SET.issuperset(self.tensors) and _KIND_SET.issuperset(self.stats)):
            for kind in list(self.tensors) + list(self.stats):
                if kind not in TENSOR_KINDS:
                    raise ValueError(f"unknown tensor kind {kind!r}; use one of {TENSOR_KINDS}")

    @property
    def numel(self) -> int:
        return numel_of(self.local_shape)

    @property
    def layout_key(self) -> tuple[str, tuple[Region, ...]]:
        """Pieces with equal layout keys hold the same elements: replicas of each other."""
        return (self.param, self.regions)

    def has(self, kind: TensorKind) -> bool:
        return kind in self.tensors or kind in self.stats


@dataclass(frozen=True, kw_only=True)
class MeshInfo:
    shape: tuple[int, ...]
    """Size of the mesh along each of its axes."""
    axis_names: tuple[str, ...]
    """One name per axis of `shape` ("dp_replicate", "tp", ...)."""
    ranks: tuple[int, ...]
    """All ranks of the mesh, row-major over `shape`."""

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.axis_names):
            raise ValueError(f"mesh shape {self.shape} and axis names {self.axis_names} differ in length")
        if numel_of(self.shape) != len(self.ranks):
            raise ValueError(
                f"mesh shape {self.shape} needs {numel_of(self.shape)} ranks, got {len(self.ranks)}"
            )


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Named process groups (each a list of rank lists), the device mesh, and the norm's reduction group."""

    groups: Mapping[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    """Group name -> every rank list of that group (one per process group)."""
    mesh: MeshInfo | None = None
    """The device mesh of DTensor parameters; None without one."""
    norm_group: str | None = None
    """The name in `groups` of the group the clip call reduced its norm over; None when unknown."""

    def group_of(self, name: str, rank: int) -> tuple[int, ...] | None:
        """The first rank list of group `name` that holds `rank`."""
        return self._rank_lists.get(name, {}).get(rank)

    @functools.cached_property
    def _rank_lists(self) -> dict[str, dict[int, tuple[int, ...]]]:
        """Group name -> rank -> its first rank list (built once: asked for every rank of a many-rank step)."""
        index: dict[str, dict[int, tuple[int, ...]]] = {}
        for name, lists in self.groups.items():
            by_rank = index[name] = {}
            for ranks in lists:
                for rank in ranks:
                    by_rank.setdefault(rank, ranks)
        return index


@dataclass(frozen=True, kw_only=True)
class ClipCall:
    """One call of a clipping function before an optimizer step."""

    reported_norm: float | None = None
    """What the call returned, as the full (for a DTensor: the reduced) value."""
    reported_local_norm: float | None = None
    """The local value a careless `.item()` on a sharded result would give."""
    max_norm: float | None = None
    """The threshold this call clipped to."""
    norm_type: float | None = None
    """`p` of this call's norm (inf for the max norm)."""
    unscaled: bool | None = None
    """True when GradScaler.unscale_ had run before this call; None when no scaler was given."""
    loss_scale: float | None = None
    """The AMP loss scale at this call, when a scaler was given."""
    clip_value: float | None = None
    """Set when the call clipped element-wise (`clip_grad_value_`): the value every gradient element was
    clamped to [-clip_value, clip_value]. Such a call clips by no norm: it has no norm or coefficient."""


@dataclass(frozen=True, kw_only=True)
class ClipRecord:
    """What the training code did and believed about clipping on this rank."""

    max_norm: float
    """The clipping threshold (positive, finite)."""
    norm_type: float = 2.0
    """`p` of the norm; inf for the max norm."""
    reported_norm: float | None = None
    """The total norm the training code logged or the clip function returned."""
    clip_coef: float | None = None
    """The coefficient the training code says it applied, when known."""
    calls: tuple[ClipCall, ...] = ()
    """One entry per clip call before this optimizer step (several under accumulation mistakes)."""
    loss_scale: float | None = None
    """The AMP loss scale at clip time."""
    unscaled_before_clip: bool | None = None
    """Whether GradScaler.unscale_ had run when clipping ran; None without a scaler."""
    found_inf: bool | None = None
    """Whether the scaler found nonfinite gradients."""
    step_skipped: bool | None = None
    """Whether this rank skipped the optimizer step."""

    def __post_init__(self) -> None:
        if not (self.max_norm > 0 and math.isfinite(self.max_norm)):
            raise ValueError(f"max_norm must be a positive finite number, got {self.max_norm!r}")
        if not (self.norm_type > 0):
            raise ValueError(f"norm_type must be positive (or inf), got {self.norm_type!r}")


@dataclass(frozen=True, kw_only=True)
class DataRecord:
    """What this rank's batch was: tokens and loss, and how the loss was reduced."""

    tokens: int | None = None
    """Tokens in this rank's batch, when logged."""
    loss: float | None = None
    """This rank's loss, when logged."""
    loss_reduction: str | None = None
    """"mean" when the rank averaged its own loss over its tokens, "sum" otherwise."""


@dataclass(frozen=True, kw_only=True)
class NotCapturedParam:
    """A parameter this rank holds but did not capture (a sparse gradient, a dtype gradaudit cannot read)."""

    name: str
    """The parameter's logical name."""
    reason: str
    """Why it was left out, as a phrase for the report."""


@dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What one rank's file says besides its pieces: who wrote it, what the training code believed,
    what it left out. The analysis reads a rank through these and its pieces through the step table
    (the guard builds them from its gathered numbers, with no file)."""

    rank: int
    """Global rank of the writer, 0 <= rank < world_size."""
    world_size: int
    """Number of ranks of the run (every rank of a step must agree)."""
    step: int
    """The optimizer step the dump is of."""
    mode: Mode = "full"
    """"full" (tensor values dumped) or "stats" (float64 statistics only, except full_params=)."""
    run_id: str | None = None
    """Identifies the run; ranks of one step must agree."""
    host: str = ""
    """Host name of the writer (provenance only)."""
    torch_version: str = ""
    """The torch that trained (provenance only)."""
    gradaudit_version: str = ""
    """The gradaudit that wrote the file."""
    created_at: str = ""
    """ISO 8601 time of writing (provenance only)."""
    params: tuple[ParamInfo, ...] = ()
    """Every logical parameter this rank knows, with its global shape and dtype."""
    topology: Topology = field(default_factory=Topology)
    """The process groups this rank could see."""
    clip: ClipRecord | None = None
    """What the training code did about clipping; None when nothing was recorded."""
    data: DataRecord = field(default_factory=DataRecord)
    """The batch: tokens, loss and its reduction, as logged."""
    num_bytes: int = 0
    """Size of the file, for the inventory."""
    not_captured: tuple[NotCapturedParam, ...] = ()
    """Parameters left out of this file, with why; their gradients are in no norm gradaudit computes."""
    capture_api: str | None = None
    """The API that wrote this file ("audit_step", "begin_audit", "dump", or an integration such as
    "DeepSpeedAudit"), so that a hint names what its user called; None in files that do not record it."""
    trigger: str | None = None
    """What wrote this file unasked: "guard" for a step `gradaudit.guard` found wrong (its pieces are
    the rank's ownership groups, or its real pieces when capture_api is "guard.params"); None for a
    capture the training code asked for."""
    trigger_note: str | None = None
    """What the writer of a triggered dump found that its pieces cannot hold (the guard: the
    parameters whose gradients were nonfinite before the step's first clip call); None: nothing."""
    tensor_kinds: tuple[TensorKind, ...] = ()
    """The kinds some piece holds values of (a key in the safetensors file)."""
    holds_flat_range: bool = False
    """Whether some piece's region is a flat range (FSDP1's and ZeRO's pieces are)."""
    all_replicated: bool = False
    """Whether the rank holds pieces and every one is replicated over a process group (DDP's are)."""

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size):
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be 'full' or 'stats', got {self.mode!r}")

    def param(self, name: str) -> ParamInfo | None:
        for info in self.params:
            if info.name == name:
                return info
        return None


@dataclass(frozen=True, kw_only=True)
class RankDump(RankFacts):
    """One rank's file: its facts and its pieces (what the pieces show of the layout is read from
    them: `tensor_kinds`, `holds_flat_range`, `all_replicated`)."""

    path: str
    """The file it was read from ("" before it is written)."""
    pieces: ColumnarPieces
    """The pieces, as columns of `params` (`as_columns(params, pieces)` of Piece objects)."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """This rank's parameter name -> logical name, for the names that differ (wrapper prefixes)."""
    header_digest: bytes = field(default=b"", compare=False, repr=False)
    """The digest of the file's header as it was loaded (b"" for a dump not read from a file), so that
    the tensor reader can refuse a file changed since without decoding it again."""
    tensor_kinds: tuple[TensorKind, ...] = field(init=False, default=())
    """Read from the pieces (`ColumnarPieces.tensor_kinds`)."""
    holds_flat_range: bool = field(init=False, default=False)
    """Read from the pieces (`ColumnarPieces.holds_flat_range`)."""
    all_replicated: bool = field(init=False, default=False)
    """Read from the pieces: their replica group column."""

    def __post_init__(self) -> None:
        super().__post_init__()
        pieces = self.pieces
        object.__setattr__(self, "tensor_kinds", pieces.tensor_kinds)
        object.__setattr__(self, "holds_flat_range", pieces.holds_flat_range)
        object.__setattr__(self, "all_replicated", bool(len(pieces) and (pieces.rows[:, 1] >= 0).all()))


@dataclass(frozen=True, kw_only=True)
class Inconsistency:
    """Ranks that disagree on something every rank must agree on (evidence for GA101)."""

    what: str
    """The thing the ranks disagree on ("world_size", "run_id", ...)."""
    values: Mapping[int, str]
    """rank -> the value that rank holds, as text."""


@dataclass(frozen=True, kw_only=True)
class StepFacts:
    """What every rank of one step says besides its pieces (`RankFacts`), cross-checked: what the
    analysis reads of a step, beside its step table."""

    directory: str
    """The step folder."""
    step: int
    """The optimizer step every rank dumped."""
    world_size: int
    """Number of ranks of the run (the ranks' own, when they agree)."""
    ranks: Mapping[int, RankFacts]
    """Rank -> its facts, for the ranks present."""
    missing_ranks: tuple[int, ...] = ()
    """Ranks of the world size without a (readable) file: every check that needs them says so."""
    inconsistencies: tuple[Inconsistency, ...] = ()
    """What the ranks disagree on (GA101)."""
    warnings: tuple[str, ...] = ()
    """Things the loader skipped (stray files), to be shown to the user."""
    unreadable_ranks: Mapping[int, str] = field(default_factory=dict)
    """Ranks whose file could not be read, with the reason (only with --allow-incomplete-ranks;
    each is also in `missing_ranks`)."""

    @functools.cached_property
    def ranks_present(self) -> tuple[int, ...]:
        """The ranks with a file, ascending (computed once: asked for every rank of a many-rank step)."""
        return tuple(sorted(self.ranks))

    @functools.cached_property
    def params(self) -> Mapping[str, ParamInfo]:
        """Every logical parameter named by any rank, first by rank order (computed once: a
        many-rank step names millions of parameters; read only)."""
        found: dict[str, ParamInfo] = {}
        last: tuple[ParamInfo, ...] | None = None
        for rank in self.ranks_present:
            params = self.ranks[rank].params
            if last is not None and (params is last or params == last):
                continue  # the previous rank's table again (the common case): nothing new
            for info in params:
                found.setdefault(info.name, info)
            last = params
        return dict(sorted(found.items()))

    @property
    def clip(self) -> ClipRecord | None:
        for rank in self.ranks_present:
            if self.ranks[rank].clip is not None:
                return self.ranks[rank].clip
        return None

    @property
    def topology(self) -> Topology:
        for rank in self.ranks_present:
            return self.ranks[rank].topology
        return Topology()


@dataclass(frozen=True, kw_only=True)
class StepDump(StepFacts):
    """All ranks of one step as the loader found them: their files, pieces included."""

    ranks: Mapping[int, RankDump]
    """Rank -> its dump, for the ranks present."""


@dataclass(frozen=True, kw_only=True)
class PieceExtras:
    """What some pieces hold beyond the columns of `ColumnarPieces`, by position (all empty for the
    pieces of a format-1.1 rank, which the columns hold whole): the format-1.0 fields."""

    tensors: Mapping[TensorKind, Mapping[int, str]] = field(default_factory=dict)
    """Tensor kind -> position -> its key in the rank's safetensors file (kinds dumped with values)."""
    absent: Mapping[TensorKind, frozenset[int]] = field(default_factory=dict)
    """Kind -> the positions whose piece holds no statistics of that kind (its column rows are zeros)."""
    odd_stats: Mapping[tuple[int, TensorKind], TensorStats] = field(default_factory=dict)
    """(position, kind) -> statistics the columns would not give back equal (another norm type,
    fingerprint length or element count than the column's); the columns hold their sums too."""
    call_stats: Mapping[int, tuple[TensorStats, ...]] = field(default_factory=dict)
    """Position -> `Piece.call_stats`, for the pieces that have them."""
    regions: Mapping[int, tuple[Region, ...]] = field(default_factory=dict)
    """Position -> the regions of a piece that is not one flat range or one box of at least one dimension."""
    local_shapes: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    """Position -> the local shape, where its regions do not imply it."""
    dtypes: Mapping[int, str] = field(default_factory=dict)
    """Position -> the dtype of the dumped values, where it is not the parameter's."""
    local_names: Mapping[int, str] = field(default_factory=dict)
    """Position -> `Piece.local_name`, where it is set."""
    partial_groups: Mapping[int, str] = field(default_factory=dict)
    """Position -> `Piece.partial_group`, where it is set."""
    indices: Mapping[int, int] = field(default_factory=dict)
    """Position -> `Piece.index`, where it is not the position."""

    @property
    def empty(self) -> bool:
        return not any(getattr(self, f.name) for f in dataclasses.fields(self))


NO_EXTRAS = PieceExtras()


class ColumnarPieces(Sequence[Piece]):
    """A rank's pieces as columns (read-only arrays, the layout of format 1.1: see
    dumpfile/columnar.py) and, for what the columns have no place for, `extras`. A `Piece` is a
    validated row built each time one is indexed or iterated, and not kept. Equal to any sequence
    of equal pieces.

    `rows` [n, 4]: param index, replica group index (-1: none), first coordinate in `coords`, ndim
    (0: a flat range [start, stop), k: a k-D box); `stats[kind]` [n, 3+f]: sum_pow, sum_sq,
    max_abs, fingerprint; `counts[kind]` [n, 3]: num_nan, num_posinf, num_neginf."""

    __slots__ = ("_numel", "coords", "counts", "extras", "groups", "norm_type", "params", "rows", "stats")

    def __init__(
        self,
        rows: np.ndarray,
        coords: np.ndarray,
        params: Sequence[ParamInfo],
        groups: Sequence[str],
        stats: Mapping[str, np.ndarray] | Mapping[TensorKind, np.ndarray],
        counts: Mapping[str, np.ndarray] | Mapping[TensorKind, np.ndarray],
        norm_type: float,
        *,
        extras: PieceExtras = NO_EXTRAS,
    ) -> None:
        self.rows, self.coords = read_only(rows), read_only(coords)
        self.params, self.groups = tuple(params), tuple(groups)
        self.stats: dict[TensorKind, np.ndarray] = {
            cast("TensorKind", k): read_only(v) for k, v in stats.items()
        }
        by_kind: Mapping[Any, np.ndarray] = counts
        self.counts: dict[TensorKind, np.ndarray] = {k: read_only(by_kind[k]) for k in self.stats}
        self.norm_type = norm_type
        self.extras = extras
        self._numel: np.ndarray | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuilt through __init__, so that the columns are read-only again after the scaled-out
        check has sent loaded ranks to another process."""
        return (_rebuild, (*self._columns(), self.extras))

    def _columns(self) -> tuple[Any, ...]:
        """The constructor's positional arguments: the columns without the extras."""
        return (self.rows, self.coords, self.params, self.groups, self.stats, self.counts, self.norm_type)

    @property
    def kinds(self) -> tuple[TensorKind, ...]:
        return cast("tuple[TensorKind, ...]", tuple(self.stats))  # validated against TENSOR_KINDS

    @property
    def fingerprint_length(self) -> int:
        return int(next(iter(self.stats.values())).shape[1]) - 3 if self.stats else 0

    @property
    def stats_only(self) -> bool:
        """Whether the columns hold these pieces whole: statistics of one kind set, fingerprint
        length and norm type, one flat range or box each, nothing else (format 1.1 can store them)."""
        widths = {int(v.shape[1]) for v in self.stats.values()}
        return bool(len(self) and self.stats and len(widths) == 1 and self.extras.empty)

    @property
    def tensor_kinds(self) -> tuple[TensorKind, ...]:
        """The kinds some piece holds values of (a key in the safetensors file)."""
        return tuple(kind for kind, keys in self.extras.tensors.items() if keys)

    @property
    def holds_flat_range(self) -> bool:
        """Whether some piece's region is a flat range (ndim 0 in the columns, or among its extra regions)."""
        extra = self.extras.regions
        plain = np.ones(len(self), dtype=bool)
        plain[list(extra)] = False
        return bool((plain & (self.rows[:, 3] == 0)).any()) or any(
            isinstance(region, FlatRange) for regions in extra.values() for region in regions
        )

    def with_tensors(self, tensors: Mapping[TensorKind, Mapping[int, str]]) -> ColumnarPieces:
        """These pieces naming the tensors `tensors` (kind -> position -> key) too."""
        merged = {k: dict(v) for k, v in self.extras.tensors.items()}
        for kind, keys in tensors.items():
            merged.setdefault(kind, {}).update(keys)
        extras = dataclasses.replace(self.extras, tensors={k: v for k, v in merged.items() if v})
        return ColumnarPieces(*self._columns(), extras=extras)

    @property
    def numel(self) -> np.ndarray:
        """Elements of each piece."""
        if self._numel is None:
            rows, coords = self.rows, self.coords
            first, ndim = rows[:, 2], rows[:, 3]
            numel = np.zeros(len(rows), dtype=np.int64)
            flat = ndim == 0
            numel[flat] = coords[first[flat] + 1] - coords[first[flat]]
            for k in np.unique(ndim[~flat]).tolist():
                chosen = np.flatnonzero(ndim == k)
                numel[chosen] = np.prod(coords[first[chosen, None] + k + np.arange(k)], axis=1)
            for position, regions in self.extras.regions.items():
                numel[position] = sum(r.numel for r in regions)
            self._numel = read_only(numel)
        return self._numel

    def regions(self) -> list[tuple[Region, ...]]:
        """`Piece.regions` of every piece, in position order, without building the pieces."""
        coords, extra, found = self.coords.tolist(), self.extras.regions, []
        for at, (_, _, first, ndim) in enumerate(self.rows.tolist()):
            if at in extra:
                found.append(extra[at])
            elif ndim == 0:
                found.append((FlatRange(start=coords[first], stop=coords[first + 1]),))
            else:
                end = first + 2 * ndim
                found.append(
                    (
                        Box(
                            offsets=tuple(coords[first : first + ndim]),
                            shape=tuple(coords[first + ndim : end]),
                        ),
                    )
                )
        return found

    def local_shape(self, position: int) -> tuple[int, ...]:
        """`Piece.local_shape` of the piece at `position`, without building the piece."""
        shape = self.extras.local_shapes.get(position)
        if shape is not None:
            return shape
        if position in self.extras.regions:
            return (int(self.numel[position]),)
        _, _, first, ndim = self.rows[position].tolist()
        if ndim == 0:
            start, stop = self.coords[first : first + 2].tolist()
            return (stop - start,)
        return tuple(self.coords[first + ndim : first + 2 * ndim].tolist())

    def layout(self, width: int) -> np.ndarray:
        """[n, 2 + width]: param index, ndim, then the region's coordinates padded with -1: rows are
        equal exactly when the pieces' layout keys are (for the same parameter table; pieces of
        one flat range or box each)."""
        rows, coords = self.rows, self.coords
        out = np.full((len(rows), 2 + width), -1, dtype=np.int64)
        out[:, 0], out[:, 1] = rows[:, 0], rows[:, 3]
        first, ndim = rows[:, 2], rows[:, 3]
        for k in np.unique(ndim).tolist():
            chosen = np.flatnonzero(ndim == k)
            w = 2 if k == 0 else 2 * k
            out[chosen, 2 : 2 + w] = coords[first[chosen, None] + np.arange(w)]
        return out

    def layout_column(self, column: int, width: int) -> np.ndarray:
        """Column `column` of `layout(width)` alone."""
        rows = self.rows
        if column < 2:
            return rows[:, 0] if column == 0 else rows[:, 3]
        first, ndim = rows[:, 2], rows[:, 3]
        if column < 4 and not ndim.any():  # flat ranges only: [start, stop)
            found: np.ndarray = self.coords[first + column - 2]
            return found
        span = np.where(ndim == 0, 2, 2 * ndim)
        inside = column - 2 < span
        return np.where(inside, self.coords[np.where(inside, first + column - 2, 0)], -1)

    @property
    def layout_width(self) -> int:
        return max(2, 2 * int(self.rows[:, 3].max())) if len(self.rows) else 2

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    @overload
    def __getitem__(self, index: int) -> Piece: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Piece, ...]: ...

    def __getitem__(self, index: int | slice) -> Piece | tuple[Piece, ...]:
        if isinstance(index, slice):
            return tuple(self.build(range(len(self))[index]))
        position = operator.index(index)
        if position < 0:
            position += len(self)
        if not 0 <= position < len(self):
            raise IndexError(f"piece index {index} out of range")
        return self.build([position])[0]

    def __iter__(self) -> Iterator[Piece]:
        n = len(self)
        for start in range(0, n, _BATCH):
            yield from self.build(range(start, min(n, start + _BATCH)))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if (
            isinstance(other, ColumnarPieces)
            and len(self) == len(other)
            and (
                self.params == other.params
                and self.groups == other.groups
                and self.kinds == other.kinds
                and self.norm_type == other.norm_type
                and self.extras == other.extras
                and np.array_equal(self.rows, other.rows)
                and np.array_equal(self.coords, other.coords)
                and all(np.array_equal(self.stats[k], other.stats[k]) for k in self.kinds)
                and all(np.array_equal(self.counts[k], other.counts[k]) for k in self.kinds)
            )
        ):
            return True
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ColumnarPieces({len(self)} pieces)"

    def build(self, positions: Iterable[int]) -> list[Piece]:
        """The pieces at these positions, as validated objects."""
        params, coords, counts, norm_type, extras = (
            self.params,
            self.coords,
            self.counts,
            self.norm_type,
            self.extras,
        )
        chosen = np.fromiter(positions, dtype=np.int64)
        group_names: list[str | None] = [*self.groups, None]  # index -1: no group
        stats_rows = [
            (
                kind,
                values[chosen].tolist(),
                counts[kind][chosen].tolist(),
                extras.absent.get(kind, frozenset()),
            )
            for kind, values in self.stats.items()
        ]
        pieces = []
        for at, (position, (param_index, group, first, ndim)) in enumerate(
            zip(chosen.tolist(), self.rows[chosen].tolist(), strict=True)
        ):
            info = params[param_index]
            regions: tuple[Region, ...]
            if position in extras.regions:
                regions = extras.regions[position]
                numel = sum(r.numel for r in regions)
                local_shape: tuple[int, ...] = (numel,)
            elif ndim == 0:
                start, stop = coords[first : first + 2].tolist()
                regions, local_shape, numel = (
                    (FlatRange(start=start, stop=stop),),
                    (stop - start,),
                    stop - start,
                )
            else:
                values = coords[first : first + 2 * ndim].tolist()
                offsets, shape = tuple(values[:ndim]), tuple(values[ndim:])
                regions, local_shape, numel = (Box(offsets=offsets, shape=shape),), shape, math.prod(shape)
            piece_stats: dict[TensorKind, TensorStats] = {}
            for kind, kind_rows, kind_counts, absent in stats_rows:
                if position in absent:
                    continue
                odd = extras.odd_stats.get((position, kind)) if extras.odd_stats else None
                if odd is not None:
                    piece_stats[kind] = odd
                    continue
                row = kind_rows[at]
                nan, posinf, neginf = kind_counts[at]
                sum_pow, sum_sq = row[0], row[1]
                if sum_pow == sum_sq and sum_pow:  # the L2 norm's two sums: one float (24 B a piece)
                    sum_pow = sum_sq
                piece_stats[kind] = TensorStats(
                    numel=numel,
                    norm_type=norm_type,
                    sum_pow=sum_pow,
                    sum_sq=sum_sq,
                    max_abs=row[2],
                    num_nan=nan,
                    num_posinf=posinf,
                    num_neginf=neginf,
                    fingerprint=tuple(row[3:]),
                )
            pieces.append(
                Piece(
                    index=extras.indices.get(position, position),
                    param=info.name,
                    regions=regions,
                    local_shape=extras.local_shapes.get(position, local_shape),
                    dtype=extras.dtypes.get(position, info.dtype),
                    local_name=extras.local_names.get(position),
                    replica_group=group_names[group],
                    tensors={k: keys[position] for k, keys in extras.tensors.items() if position in keys},
                    stats=piece_stats,
                    call_stats=extras.call_stats.get(position, ()),
                    partial_group=extras.partial_groups.get(position),
                )
            )
        return pieces


_BATCH = 1024


def _rebuild(*args: Any) -> ColumnarPieces:
    *columns, extras = args
    return ColumnarPieces(*columns, extras=extras)


def read_only(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def as_columns(params: Sequence[ParamInfo], pieces: Sequence[Piece]) -> ColumnarPieces:
    """`pieces` (of parameters in `params`) as columns: the one conversion of Piece objects."""
    columns = PieceColumnsBuilder(params)
    for piece in pieces:
        columns.add(piece)
    return columns.result()


class PieceColumnsBuilder:
    """The columns of pieces as lists (or arrays), filled a piece at a time from Piece objects
    (`add`) or a column at a time by the format-1.0 decoder (dumpfile/columnar.py), then
    `result()`: the columns, and what they have no place for in `PieceExtras`."""

    def __init__(self, params: Sequence[ParamInfo]) -> None:
        self.params = tuple(params)
        self.index_of = {info.name: i for i, info in enumerate(self.params)}
        self.param: list[int] | np.ndarray = []
        """Per piece: its parameter's index in `params`; then its replica group, the position of
        its region's first coordinate in `coords` and the region's ndim (0: a flat range)."""
        self.groups: list[str | None] = []
        self.first: list[int] | np.ndarray = []
        self.ndim: list[int] | np.ndarray = []
        self.coords: list[int] | np.ndarray = []
        self.norm_type: float | None = None
        self.stats: dict[TensorKind, tuple[int, Any, Any, Any]] = {}
        """Kind -> (fingerprint length, the positions that have it, their sum_pow, sum_sq, max_abs
        and fingerprint rows, their num_nan, num_posinf, num_neginf rows)."""
        self.tensors: dict[TensorKind, dict[int, str]] = {}
        self.odd: dict[tuple[int, TensorKind], TensorStats] = {}
        self.extra: dict[str, dict[int, Any]] = {f.name: {} for f in dataclasses.fields(PieceExtras)[3:]}
        """PieceExtras' fields by position (those after tensors, absent and odd_stats), by name."""

    def add(self, piece: Piece) -> None:
        param_index = self.index_of.get(piece.param)
        if param_index is None:
            raise ValueError(f"piece {piece.index} is of {piece.param!r}, which is not in the dump's params")
        params, firsts, ndims, coords = cast(
            "tuple[list[int], ...]", (self.param, self.first, self.ndim, self.coords)
        )
        position, regions, local_shape, extra = len(params), piece.regions, piece.local_shape, self.extra
        region = regions[0] if len(regions) == 1 else None
        numel = math.prod(local_shape)
        implied: tuple[int, ...] = (numel,)
        params.append(param_index)
        self.groups.append(piece.replica_group)
        firsts.append(len(coords))
        if type(region) is Box and region.shape:
            ndims.append(len(region.shape))
            coords += (*region.offsets, *region.shape)
            implied = region.shape
        else:
            ndims.append(0)
            if type(region) is FlatRange:
                coords += (region.start, region.stop)
            else:
                coords += (0, 0)
                extra["regions"][position] = regions
        if local_shape != implied:
            extra["local_shapes"][position] = local_shape
        if piece.dtype != self.params[param_index].dtype:
            extra["dtypes"][position] = piece.dtype
        if piece.call_stats:
            extra["call_stats"][position] = piece.call_stats
        if piece.local_name is not None:
            extra["local_names"][position] = piece.local_name
        if piece.partial_group is not None:
            extra["partial_groups"][position] = piece.partial_group
        if piece.index != position:
            extra["indices"][position] = piece.index
        for kind, key in piece.tensors.items():
            self.tensors.setdefault(kind, {})[position] = key
        for kind, s in piece.stats.items():
            if self.norm_type is None:
                self.norm_type = s.norm_type
            width, positions, values, counts = self.stats.setdefault(kind, (len(s.fingerprint), [], [], []))
            fingerprint = s.fingerprint[:width] + (0.0,) * (width - len(s.fingerprint))
            positions.append(position)
            values.append((s.sum_pow, s.sum_sq, s.max_abs, *fingerprint))
            counts.append((s.num_nan, s.num_posinf, s.num_neginf))
            if not (
                (s.norm_type == self.norm_type or (math.isnan(s.norm_type) and math.isnan(self.norm_type)))
                and len(s.fingerprint) == width
                and s.numel == numel
            ):
                self.odd[(position, kind)] = s

    def result(self) -> ColumnarPieces:
        n = len(self.param)
        groups = sorted({g for g in self.groups if g is not None})
        group_index: dict[str | None, int] = {g: i for i, g in enumerate(groups)}
        group_index[None] = -1
        rows = np.zeros((n, 4), dtype=np.int64)
        rows[:, 0], rows[:, 2], rows[:, 3] = self.param, self.first, self.ndim
        rows[:, 1] = [group_index[g] for g in self.groups]
        values, counted, absent = {}, {}, {}
        for kind in sorted(self.stats):
            width, positions, kind_values, kind_counts = self.stats[kind]
            values[kind] = np.zeros((n, 3 + width), dtype=np.float64)
            counted[kind] = np.zeros((n, 3), dtype=np.int64)
            values[kind][positions] = np.asarray(kind_values, dtype=np.float64).reshape(
                len(positions), 3 + width
            )
            counted[kind][positions] = np.asarray(kind_counts, dtype=np.int64).reshape(len(positions), 3)
            if len(positions) < n:
                absent[kind] = frozenset(range(n)) - frozenset(np.asarray(positions).tolist())
        extras = PieceExtras(tensors=self.tensors, absent=absent, odd_stats=self.odd, **self.extra)
        return ColumnarPieces(
            rows,
            np.asarray(self.coords, dtype=np.int64),
            self.params,
            groups,
            values,
            counted,
            self.norm_type if self.norm_type is not None else 2.0,
            extras=extras if not extras.empty else NO_EXTRAS,
        )
