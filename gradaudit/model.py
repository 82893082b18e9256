"""The in-memory description of a dumped step: frozen values, no I/O, no torch."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

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


def read_only(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array
