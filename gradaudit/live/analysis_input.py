"""The boundary between the guard and the analysis: the per-rank summary every rank gathered, turned
into the analysis value, so that the guard's verdict and `gradaudit check` come from one analysis.

`analysis_of` builds the step table straight from the gathered numbers (one entry per rank and
ownership group it holds, replicas of a group sharing a layout, each entry's statistics those of one
element whose magnitude is the group's norm), and the replica sets from its columns: nothing is
measured and no tensor read, and every accounting the diagnosis tries gives the number it would from
the real pieces. The step's facts (clip records, topology, parameters) come from the step the guard's
dump amounts to (`rank_dumps`: one stats-mode `RankDump` per rank, which the guard also writes on an
anomaly); `report_of` runs `audit.build_report` on the analysis, as `audit.audit_step` does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..measure.measurements import gradient_scale_of, piece_measurement, unscaled_sums
from ..model import (
    ClipCall,
    ClipRecord,
    FlatRange,
    ParamInfo,
    Piece,
    RankDump,
    StepDump,
    TensorKind,
    TensorStats,
    Topology,
    as_columns,
)
from ..norms import INF, NAN, UNKNOWN
from ..steptable import (
    KindColumns,
    ParamMeasurement,
    PieceMeasurement,
    ReplicaCopy,
    ReplicaSet,
    StepMeasurements,
    StepTable,
)

if TYPE_CHECKING:
    import numpy as np

    from ..checks.base import Analysis
    from ..report.model import Report

SHARDED = "sharded"
"""The name of the group of pieces no other rank holds a replica of."""


@dataclass(frozen=True, kw_only=True)
class OwnershipGroup:
    """Pieces owned alike: each rank's own shards, or the pieces replicated over one process group."""

    name: str
    replica_group: str | None
    """The process group the pieces are replicated over; None for pieces held by one rank only."""
    dtype: str = "float32"

    @property
    def param(self) -> str:
        """The name the group has in the analysis and its reports."""
        if self.replica_group is None:
            return "<sharded pieces>"
        return f"<pieces replicated over {self.replica_group}>"


@dataclass(frozen=True, kw_only=True)
class CallSummary:
    """One clip call on one rank: what it returned and the gradient just before it."""

    reported_norm: float | None
    max_norm: float | None = None
    norm_type: float | None = None
    coef: float | None = None
    """The coefficient this call applied, measured on a fixed sample of elements before and after it."""
    terms: tuple[float, ...] = ()
    """Per ownership group: sum |g|^p of the gradient just before this call (max |g| for the inf-norm)."""


@dataclass(frozen=True, kw_only=True)
class RankSummary:
    """What one rank measured of one step (every number of it travelled in one gathered vector)."""

    rank: int
    terms: tuple[float, ...]
    """Per ownership group: sum |g|^p of the gradient before the last clip call (at the optimizer step
    when no clip call was made)."""
    held: tuple[bool, ...]
    """Per ownership group: whether this rank holds pieces of it."""
    num_nan: tuple[int, ...] = ()
    """Per ownership group: pieces holding a nan (not elements: the norm shows a nan, not how many)."""
    num_inf: tuple[int, ...] = ()
    applied_coef: float | None = None
    """The coefficient between `terms`' moment and the optimizer step, from the fixed sample."""
    calls: tuple[CallSummary, ...] = ()
    num_calls: int = 0
    """Every clip call of the step (only the first few are in `calls`)."""
    topology: Topology = field(default_factory=Topology)
    loss_scale: float | None = None
    unscaled: bool | None = None
    """Whether GradScaler.unscale_ had run at the first clip call (None: no scaler)."""
    skipped: bool | None = None
    """Whether the scaler skipped the optimizer step (found_inf); None: no scaler."""
    grad_dtype: str | None = None
    """The loosest dtype of this rank's gradients (FSDP1 keeps bfloat16 gradients of float32
    parameters): the tolerance the analysis allows goes by it."""

    def __post_init__(self) -> None:
        if len(self.held) != len(self.terms):
            raise ValueError(f"rank {self.rank}: {len(self.terms)} group terms for {len(self.held)} groups")


@dataclass(frozen=True, kw_only=True)
class LiveStep:
    """One checked step of every rank, as the guard gathered it."""

    step: int
    world_size: int
    max_norm: float
    norm_type: float
    groups: tuple[OwnershipGroup, ...]
    ranks: Mapping[int, RankSummary]
    run_id: str | None = None
    directory: str = ""
    """Where the step's dump is (or would be) written; the reports name it."""


class _Held(NamedTuple):
    """One ownership group on one rank that holds it, what its piece of the guard's dump and its entry
    of the step table are made of: its replica class's element (`position`) in the group's
    one-dimensional parameter; sum |g|^p (max |g| for the inf-norm; nonfinite as 0, the counts tell);
    the term after clipping (the same elements scaled by the sample's coefficient; None unless that
    is finite and the group too); the term before each clip call when the rank made two or more."""

    rank: int
    group: int
    position: int
    term: float
    num_nan: int
    num_inf: int
    clipped: float | None
    calls: tuple[float, ...]


def _held(live: LiveStep) -> dict[int, list[_Held]]:
    """Rank -> every group it holds, in group order; the ranks in order."""
    layouts, p = _layouts(live), live.norm_type
    by_rank: dict[int, list[_Held]] = {}
    for rank, summary in sorted(live.ranks.items()):
        coef, found = summary.applied_coef, by_rank.setdefault(rank, [])
        for i, group in enumerate(live.groups):
            if not summary.held[i]:
                continue
            num_nan = summary.num_nan[i] if summary.num_nan else 0
            num_inf = summary.num_inf[i] if summary.num_inf else 0
            term = summary.terms[i] if math.isfinite(summary.terms[i]) else 0.0
            clipped = None
            if coef is not None and math.isfinite(coef) and not (num_nan or num_inf):
                clipped = term * abs(coef) ** p if not math.isinf(p) else term * abs(coef)
            calls = () if len(summary.calls) < 2 else summary.calls
            call_terms = tuple(c.terms[i] if c.terms and math.isfinite(c.terms[i]) else 0.0 for c in calls)
            position = layouts[i][_class_of(live, group, summary)]
            found.append(_Held(rank, i, position, term, num_nan, num_inf, clipped, call_terms))
    return by_rank


def _piece(live: LiveStep, h: _Held, index: int) -> Piece:
    """The piece of the guard's dump that one ownership group on one rank amounts to: one element
    whose magnitude is the group's norm, at its replica class's position."""
    group, p = live.groups[h.group], live.norm_type
    stats: dict[TensorKind, TensorStats] = {
        "grad": _one_element(h.term, p, num_nan=h.num_nan, num_inf=h.num_inf)
    }
    if h.clipped is not None:
        stats["grad_clipped"] = _one_element(h.clipped, p)
    return Piece(
        index=index,
        param=group.param,
        regions=(FlatRange(start=h.position, stop=h.position + 1),),
        local_shape=(1,),
        dtype=live.ranks[h.rank].grad_dtype or group.dtype,
        replica_group=group.replica_group,
        stats=stats,
        call_stats=tuple(_one_element(term, p) for term in h.calls),
    )


def rank_dumps(live: LiveStep) -> dict[int, RankDump]:
    """The stats-mode rank dumps the live step amounts to (what the guard writes on an anomaly)."""
    layouts, held = _layouts(live), _held(live)
    params = tuple(
        ParamInfo(name=g.param, global_shape=(len(layouts[i]),), dtype=g.dtype)
        for i, g in enumerate(live.groups)
        if layouts[i]
    )
    dumps = {}
    for rank, summary in sorted(live.ranks.items()):
        pieces: list[Piece] = []
        for h in held[rank]:
            pieces.append(_piece(live, h, len(pieces)))
        rank_params = tuple(p for p in params if any(piece.param == p.name for piece in pieces))
        dumps[rank] = RankDump(
            path="",
            rank=rank,
            world_size=live.world_size,
            step=live.step,
            mode="stats",
            run_id=live.run_id,
            params=rank_params,
            pieces=as_columns(rank_params, pieces),
            topology=summary.topology,
            clip=_clip_record(live, summary),
            capture_api="guard",
        )
    return dumps


def analysis_of(live: LiveStep) -> Analysis:
    """What every check receives for the live step, as `audit.analyse` makes it of the guard's dump
    measured, but from the gathered numbers: the step table and the replica sets built from them
    (nothing measured, no tensor read), the facts from the step the guard's dump amounts to."""
    from ..audit import analyse

    step = step_dump(live)
    table, replicas = _step_table(live, tuple(step.params))
    measurements = StepMeasurements(
        norm_type=live.norm_type,
        params={
            name: ParamMeasurement(
                param=name, norm_type=live.norm_type, pieces=(), replica_sets=replicas.get(name, ())
            )
            for name in sorted(step.params)
        },
    )
    return analyse(step, measurements, table=table, update_judgements={})


def _step_table(
    live: LiveStep, param_names: tuple[str, ...]
) -> tuple[StepTable, dict[str, tuple[ReplicaSet, ...]]]:
    """The step table of the live step (one entry per rank and ownership group it holds, in
    parameter, rank, piece order, as the guard's dump measured gives it) and its replica sets."""
    import numpy as np

    p = live.norm_type
    held = [(h, k) for own in _held(live).values() for k, h in enumerate(own)]
    held.sort(key=lambda e: (live.groups[e[0].group].param, e[0].rank, e[1]))
    ids = {name: i for i, name in enumerate(param_names)}
    scales = np.array([_gradient_scale(live, h.rank) for h, _ in held])
    grad = [_one_element(h.term, p, num_nan=h.num_nan, num_inf=h.num_inf) for h, _ in held]
    counts = np.array([(s.num_nan, s.num_posinf, s.num_neginf) for s in grad], dtype=np.int64).reshape(-1, 3)
    sum_pow, sum_sq, max_abs = _unscaled_columns(grad, scales, p)
    term = max_abs if math.isinf(p) else sum_pow
    flags = (counts[:, 0] > 0).astype(np.int8) * NAN | ((counts[:, 1] + counts[:, 2]) > 0).astype(
        np.int8
    ) * INF
    has = np.ones(len(held), dtype=bool)
    layout = np.array([_layout_id(live, h) for h, _ in held], dtype=np.int64)
    rank = np.array([h.rank for h, _ in held], dtype=np.int64)
    index = np.array([k for _, k in held], dtype=np.int64)
    dtypes = [live.ranks[h.rank].grad_dtype or live.groups[h.group].dtype for h, _ in held]

    def rows(at: np.ndarray) -> list[PieceMeasurement]:
        """The pieces of the guard's dump at these positions, measured: built only when asked."""
        return [
            piece_measurement(int(rank[i]), _piece(live, *held[i]), float(scales[i])) for i in at.tolist()
        ]

    zeros = np.zeros(len(held))
    table = StepTable(
        norm_type=p,
        rank=rank,
        index=index,
        param=np.array([ids[live.groups[h.group].param] for h, _ in held], dtype=np.int64),
        param_names=param_names,
        layout=layout,
        dtypes=frozenset(dtypes),
        grad=KindColumns(
            has=has, sum_pow=sum_pow, sum_sq=sum_sq, max_abs=max_abs, counts=counts, term=term, flags=flags
        ),
        clipped=_clipped_columns(live, [h for h, _ in held], scales),
        has_dots=np.zeros(len(held), dtype=bool),
        dot_pre_post=zeros,
        dot_pre_pre=zeros,
        has_update=np.zeros(len(held), dtype=bool),
        distinct_layouts=bool(np.unique(layout).size == layout.size),
        rows=rows,
    )
    return table, _replica_sets(table, [live.groups[h.group].param for h, _ in held], dtypes, held)


def _unscaled_columns(
    stats: list[TensorStats], scales: np.ndarray, p: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sum |x|^p, sum x^2, max |x|) of these statistics, each divided by its rank's loss scale as
    measuring the guard's dump divides them (measurements.unscaled_sums, by rank)."""
    import numpy as np

    sum_pow, sum_sq, max_abs = (np.array([getattr(s, f) for s in stats], dtype=np.float64) for f in _SUMS)
    for scale in np.unique(scales[scales != 1.0]).tolist():
        at = scales == scale
        sum_pow[at], sum_sq[at], max_abs[at] = unscaled_sums(sum_pow[at], sum_sq[at], max_abs[at], scale, p)
    return sum_pow, sum_sq, max_abs


_SUMS = ("sum_pow", "sum_sq", "max_abs")


def _clipped_columns(live: LiveStep, held: list[_Held], scales: np.ndarray) -> KindColumns | None:
    """The clipped gradient's columns (UNKNOWN where a group has none); None when no group has one."""
    import numpy as np

    has = np.array([h.clipped is not None for h in held], dtype=bool)
    if not has.any():
        return None
    p = live.norm_type
    stats = [_one_element(0.0 if h.clipped is None else h.clipped, p) for h in held]
    sum_pow, sum_sq, max_abs = _unscaled_columns(stats, scales, p)
    return KindColumns(
        has=has,
        sum_sq=np.where(has, sum_sq, 0.0),
        max_abs=np.where(has, max_abs, 0.0),
        counts=np.zeros((len(held), 3), dtype=np.int64),
        term=np.where(has, max_abs if math.isinf(p) else sum_pow, 0.0),
        flags=np.where(has, 0, UNKNOWN).astype(np.int8),
    )


def _replica_sets(
    table: StepTable, params: list[str], dtypes: list[str], held: list[tuple[_Held, int]]
) -> dict[str, tuple[ReplicaSet, ...]]:
    """Parameter -> its groups held on several ranks, each copy compared with the lowest rank's as
    measuring the guard's dump compares statistics-only copies (their sums, their nonfinite counts)."""
    import numpy as np

    grad = table.grad
    copies = np.bincount(table.layout)[table.layout]
    by_layout: dict[int, list[int]] = {}
    for i in table.by_rank_order.tolist():
        if copies[i] > 1:
            by_layout.setdefault(int(table.layout[i]), []).append(i)
    found: dict[str, list[ReplicaSet]] = {}
    nonfinite = grad.nonfinite
    for base, *others in sorted(by_layout.values(), key=lambda at: (table.rank[at[0]], table.index[at[0]])):
        position = held[base][0].position

        def delta(i: int, base: int = base) -> float:
            if nonfinite[i] != nonfinite[base]:
                return math.inf
            return max(
                abs(math.sqrt(grad.sum_sq[i]) - math.sqrt(grad.sum_sq[base])),
                abs(float(grad.max_abs[i]) - float(grad.max_abs[base])),
            )

        found.setdefault(params[base], []).append(
            ReplicaSet(
                param=params[base],
                regions=(FlatRange(start=position, stop=position + 1),),
                dtype=dtypes[base],
                base_rank=int(table.rank[base]),
                base_index=int(table.index[base]),
                base_max_abs=float(grad.max_abs[base]),
                base_sum_sq=float(grad.sum_sq[base]),
                numel=1,
                copies=tuple(
                    ReplicaCopy(
                        rank=int(table.rank[i]), index=int(table.index[i]), fingerprint_delta=delta(i)
                    )
                    for i in others
                ),
                by_values=False,
            )
        )
    return {name: tuple(sets) for name, sets in found.items()}


def _layout_id(live: LiveStep, h: _Held) -> int:
    """Equal exactly for the copies of one replica class of one group."""
    return h.group * (len(live.ranks) + 1) + h.position


def _gradient_scale(live: LiveStep, rank: int) -> float:
    """How many times the true gradient the rank's measured gradients are: the rule loading the
    guard's dump applies to its clip record (the loss scale when clipping ran before unscale_)."""
    return gradient_scale_of(_clip_record(live, live.ranks[rank]))


def step_dump(live: LiveStep) -> StepDump:
    """The live step as the loader would give it after reading `rank_dumps(live)`."""
    from ..dumpfile.loader import assemble_step

    return assemble_step(live.directory, rank_dumps(live))


def _class_of(live: LiveStep, group: OwnershipGroup, summary: RankSummary) -> tuple[int, ...]:
    """The ranks whose pieces of `group` are replicas of this rank's: the replica group's rank list."""
    if group.replica_group is None:
        return (summary.rank,)
    members = summary.topology.group_of(group.replica_group, summary.rank)
    return members if members else (summary.rank,)


def _layouts(live: LiveStep) -> list[dict[tuple[int, ...], int]]:
    """Per group: each replica class -> its element in the group's one-dimensional parameter."""
    found = []
    for i, group in enumerate(live.groups):
        classes = {_class_of(live, group, s) for s in live.ranks.values() if s.held[i]}
        found.append({members: n for n, members in enumerate(sorted(classes))})
    return found


def _one_element(term: float, norm_type: float, *, num_nan: int = 0, num_inf: int = 0) -> TensorStats:
    """Statistics of one element whose magnitude is the group's norm: sum |x|^p is the group's term."""
    magnitude = term if math.isinf(norm_type) else term ** (1.0 / norm_type) if term > 0 else 0.0
    return TensorStats(
        numel=1,
        norm_type=norm_type,
        sum_pow=magnitude if math.isinf(norm_type) else term,
        sum_sq=magnitude * magnitude,
        max_abs=magnitude,
        num_nan=num_nan,
        num_posinf=num_inf,
    )


def _clip_record(live: LiveStep, summary: RankSummary) -> ClipRecord:
    calls = tuple(
        ClipCall(
            reported_norm=c.reported_norm,
            max_norm=c.max_norm,
            norm_type=c.norm_type,
            unscaled=summary.unscaled,
            loss_scale=summary.loss_scale,
        )
        for c in summary.calls
    )
    return ClipRecord(
        max_norm=live.max_norm,
        norm_type=live.norm_type,
        reported_norm=calls[-1].reported_norm if calls else None,
        calls=calls,
        loss_scale=summary.loss_scale,
        unscaled_before_clip=summary.unscaled if calls else None,
        found_inf=summary.skipped,
        step_skipped=summary.skipped,
    )


def report_of(live: LiveStep) -> Report:
    """The report `gradaudit check` gives for the live step: `analysis_of(live)` through the offline
    pipeline's last stage (audit.build_report), as audit.audit_step runs it without a reference."""
    from ..audit import build_report, command_for
    from ..checks.base import AuditOptions
    from ..measure.measure import overflow_notes

    inputs = analysis_of(live)
    options = AuditOptions()
    command = command_for(live.directory, options) if live.directory else ""
    return build_report(inputs, options, command=command, warnings=overflow_notes(inputs.table))
