"""The boundary between the guard and the analysis: the per-rank summary every rank gathered, turned
into the analysis value, so that the guard's verdict and `gradaudit check` come from one analysis.

`analysis_of` builds the step table straight from the gathered numbers (one entry per rank and
ownership group it holds, replicas of a group sharing a layout, each entry's statistics those of one
element whose magnitude is the group's norm), and the replica sets from its columns: nothing is
measured and no tensor read, and every accounting the diagnosis tries gives the number it would from
the real pieces; the step's facts (clip records, topology, parameters) and the coverage too, with no
dump built. `report_of` runs `audit.build_report` on the analysis, as `audit.audit_step_dir` does. Only
on an anomaly does the guard build its rank's dump (`rank_dump`: one piece per ownership group).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from ..measure.measurements import call_columns, call_row, call_scale, gradient_scale_of, unscaled_sums
from ..model import (
    ClipCall,
    ClipRecord,
    FlatRange,
    ParamInfo,
    Piece,
    RankFacts,
    TensorKind,
    TensorStats,
    Topology,
)
from ..norms import INF, NAN, UNKNOWN
from ..steptable import (
    KindColumns,
    ParamMeasurement,
    ReplicaCopy,
    ReplicaSet,
    StepMeasurements,
    StepTable,
)

if TYPE_CHECKING:
    import numpy as np

    from ..analysis.coverage import ParamCoverage
    from ..checks.base import Analysis
    from ..dumpfile.dump import RankDump
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


class _Gathered(NamedTuple):
    """Every ownership group on every rank that holds it (`_held`, in rank then group order) and the
    statistics of the piece each amounts to, as columns: one Python object per rank and group, none
    per statistic (a failing step of many thousand ranks is diagnosed within a second)."""

    held: list[_Held]
    bounds: dict[int, tuple[int, int]]
    """Rank -> its first and past-last position in `held`."""
    layouts: list[dict[tuple[int, ...], int]]
    grad: np.ndarray
    """[n, 3]: sum |x|^p, sum x^2, max |x| of each one-element piece (before dividing a loss scale out)."""
    counts: np.ndarray
    """[n, 3]: num_nan, num_posinf, num_neginf."""
    clipped: np.ndarray
    """[n, 3]: as `grad`, of the clipped gradient; zeros where a group has none."""
    has_clipped: np.ndarray
    coords: np.ndarray
    """[n, 2]: each piece's flat range, its replica class's element."""
    clips: dict[int, ClipRecord]


def _gathered(live: LiveStep) -> _Gathered:
    import numpy as np

    classes = _classes(live)
    layouts = _layouts(classes)
    by_rank, p = _held(live, classes, layouts), live.norm_type
    held = [h for own in by_rank.values() for h in own]
    bounds, at = {}, 0
    for rank, own in by_rank.items():
        bounds[rank], at = (at, at + len(own)), at + len(own)
    clipped = [h.clipped for h in held]
    return _Gathered(
        held=held,
        bounds=bounds,
        layouts=layouts,
        grad=_sum_columns([h.term for h in held], p),
        counts=np.array([(h.num_nan, h.num_inf, 0) for h in held], dtype=np.int64).reshape(-1, 3),
        clipped=_sum_columns([c or 0.0 for c in clipped], p),
        has_clipped=np.array([c is not None for c in clipped], dtype=bool),
        coords=np.array([(h.position, h.position + 1) for h in held], dtype=np.int64).reshape(-1, 2),
        clips=_clip_records(live),
    )


def _sums(term: float, norm_type: float) -> tuple[float, float, float]:
    """(sum |x|^p, sum x^2, max |x|) of one element whose magnitude is the group's norm."""
    if math.isinf(norm_type):
        return term, term * term, term
    magnitude = term ** (1.0 / norm_type) if term > 0 else 0.0
    return term, magnitude * magnitude, magnitude


def _sum_columns(terms: list[float], norm_type: float) -> np.ndarray:
    """[n, 3]: `_sums` of each term, the same numbers (the root of each taken as `_sums` takes it)."""
    import numpy as np

    term = np.array(terms, dtype=np.float64).reshape(-1)
    if math.isinf(norm_type):
        magnitude = term
    else:
        root = 1.0 / norm_type
        magnitude = np.array([t**root if t > 0 else 0.0 for t in terms], dtype=np.float64).reshape(-1)
    return np.stack((term, magnitude * magnitude, magnitude), axis=1)


def _held(
    live: LiveStep, classes: list[dict[int, tuple[int, ...]]], layouts: list[dict[tuple[int, ...], int]]
) -> dict[int, list[_Held]]:
    """Rank -> every group it holds, in group order; the ranks in order."""
    p, inf = live.norm_type, math.isinf(live.norm_type)
    groups = range(len(live.groups))
    by_rank: dict[int, list[_Held]] = {}
    for rank, summary in sorted(live.ranks.items()):
        coef, found = summary.applied_coef, by_rank.setdefault(rank, [])
        scales = coef is not None and math.isfinite(coef)
        calls = () if len(summary.calls) < 2 else summary.calls
        num_nans, num_infs, terms, held = summary.num_nan, summary.num_inf, summary.terms, summary.held
        for i in groups:
            if not held[i]:
                continue
            num_nan = num_nans[i] if num_nans else 0
            num_inf = num_infs[i] if num_infs else 0
            term = terms[i] if math.isfinite(terms[i]) else 0.0
            clipped = None
            if scales and not (num_nan or num_inf):
                assert coef is not None
                clipped = term * abs(coef) ** p if not inf else term * abs(coef)
            call_terms = (
                tuple(c.terms[i] if c.terms and math.isfinite(c.terms[i]) else 0.0 for c in calls)
                if calls
                else ()
            )
            position = layouts[i][classes[i][rank]]
            found.append(_Held(rank, i, position, term, num_nan, num_inf, clipped, call_terms))
    return by_rank


def rank_dump(live: LiveStep, rank: int) -> RankDump:
    """The stats-mode dump of `rank` the live step amounts to (what the guard writes on an anomaly)."""
    return _rank_dump(live, _gathered(live), rank)


def _group_params(live: LiveStep, g: _Gathered) -> tuple[ParamInfo, ...]:
    """The parameter each ownership group some rank holds is in the guard's dump: one element per
    replica class."""
    return tuple(
        ParamInfo(name=group.param, global_shape=(len(g.layouts[i]),), dtype=group.dtype)
        for i, group in enumerate(live.groups)
        if g.layouts[i]
    )


def _params_of(live: LiveStep, params: tuple[ParamInfo, ...], groups: Sequence[int]) -> tuple[ParamInfo, ...]:
    """The parameters (of the groups' `params`) a rank holding these ownership groups knows."""
    names = {live.groups[i].param for i in groups}
    return tuple(info for info in params if info.name in names)


def _rank_facts(live: LiveStep, g: _Gathered) -> dict[int, RankFacts]:
    """Each rank's facts: what its dump (`_rank_dump`) says besides its pieces, with no dump built."""
    params = _group_params(live, g)
    shared: dict[tuple[int, ...], tuple[tuple[ParamInfo, ...], bool]] = {}
    facts = {}
    for rank, summary in sorted(live.ranks.items()):
        lo, hi = g.bounds[rank]
        held = tuple(h.group for h in g.held[lo:hi])
        if held not in shared:
            replicated = bool(held) and all(live.groups[i].replica_group is not None for i in held)
            shared[held] = (_params_of(live, params, held), replicated)
        rank_params, replicated = shared[held]
        facts[rank] = RankFacts(
            rank=rank,
            world_size=live.world_size,
            step=live.step,
            mode="stats",
            run_id=live.run_id,
            params=rank_params,
            topology=summary.topology,
            clip=g.clips[rank],
            capture_api="guard",
            holds_flat_range=bool(held),  # each group's piece: one element of a flat range
            all_replicated=replicated,
        )
    return facts


def _coverage(live: LiveStep, g: _Gathered, params: Mapping[str, ParamInfo]) -> dict[str, ParamCoverage]:
    """Who holds which element of each group's parameter: each element (a replica class) by that
    class's ranks, and no element by two classes, as `coverage_by_param` finds the guard's dump."""
    from ..analysis.coverage import ParamCoverage
    from ..analysis.geometry import Coverage

    holders: dict[str, list[int]] = {}
    for h in g.held:  # by rank
        holders.setdefault(live.groups[h.group].param, []).append(h.rank)
    whole = Coverage(num_gap_elements=0, num_overlap_elements=0, overlapping_tags=frozenset())
    return {name: ParamCoverage(info, whole, [], sorted(set(holders[name]))) for name, info in params.items()}


def _rank_dump(live: LiveStep, g: _Gathered, rank: int) -> RankDump:
    """`rank`'s dump: its facts, and one piece per ownership group it holds (`_piece`)."""
    from ..dumpfile.dump import RankDump, as_columns

    lo, hi = g.bounds[rank]
    held = g.held[lo:hi]
    params = _params_of(live, _group_params(live, g), [h.group for h in held])
    return RankDump(
        path="",
        rank=rank,
        world_size=live.world_size,
        step=live.step,
        mode="stats",
        run_id=live.run_id,
        params=params,
        pieces=as_columns(params, [_piece(live, h, k) for k, h in enumerate(held)]),
        topology=live.ranks[rank].topology,
        clip=g.clips[rank],
        capture_api="guard",
    )


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


def analysis_of(live: LiveStep) -> Analysis:
    """What every check receives for the live step, as `audit.analyse` makes it of the guard's dump
    measured, but from the gathered numbers: the step table and the replica sets built from them
    (nothing measured, no tensor read), the facts from the step the guard's dump amounts to."""
    from ..audit import analyse
    from ..dumpfile.loader import assemble_facts

    g = _gathered(live)
    step = assemble_facts(live.directory, _rank_facts(live, g))
    table, replicas = _step_table(live, g, tuple(step.params))
    measurements = StepMeasurements(
        norm_type=live.norm_type,
        params={
            name: ParamMeasurement(param=name, norm_type=live.norm_type, replica_sets=replicas.get(name, ()))
            for name in sorted(step.params)
        },
        table=table,
    )
    return analyse(step, measurements, coverage=_coverage(live, g, step.params), update_judgements={})


def _step_table(
    live: LiveStep, g: _Gathered, param_names: tuple[str, ...]
) -> tuple[StepTable, dict[str, tuple[ReplicaSet, ...]]]:
    """The step table of the live step (one entry per rank and ownership group it holds, in
    parameter, rank, piece order, as the guard's dump measured gives it) and its replica sets."""
    import numpy as np

    p, ids = live.norm_type, {name: i for i, name in enumerate(param_names)}
    rank = np.array([h.rank for h in g.held], dtype=np.int64)
    group = np.array([h.group for h in g.held], dtype=np.int64)
    spans = np.array(list(g.bounds.values()), dtype=np.int64).reshape(-1, 2)  # by rank, contiguous
    index = np.arange(rank.size) - np.repeat(spans[:, 0], spans[:, 1] - spans[:, 0])
    param = np.array([ids.get(owned.param, -1) for owned in live.groups], dtype=np.int64)[group]
    order = np.lexsort((index, rank, param))
    held = list(zip([g.held[i] for i in order.tolist()], index[order].tolist(), strict=True))
    rank, index, param, group = rank[order], index[order], param[order], group[order]
    by_rank = {r: gradient_scale_of(clip) for r, clip in g.clips.items()}
    scales = np.array([by_rank[r] for r in rank.tolist()], dtype=np.float64)
    counts = g.counts[order]
    sum_pow, sum_sq, max_abs = _unscaled_columns(g.grad[order], scales, p)
    term = max_abs if math.isinf(p) else sum_pow
    flags = (counts[:, 0] > 0).astype(np.int8) * NAN | ((counts[:, 1] + counts[:, 2]) > 0).astype(
        np.int8
    ) * INF
    layout = group * (len(live.ranks) + 1) + g.coords[order, 0]
    grad_dtypes = {r: s.grad_dtype for r, s in live.ranks.items()}
    dtypes = [grad_dtypes[h.rank] or live.groups[h.group].dtype for h, _ in held]

    zeros = np.zeros(len(held))
    table = StepTable(
        norm_type=p,
        rank=rank,
        index=index,
        param=param,
        param_names=param_names,
        layout=layout,
        dtypes=frozenset(dtypes),
        grad=KindColumns(
            has=np.ones(len(held), dtype=bool),
            sum_sq=sum_sq,
            max_abs=max_abs,
            counts=counts,
            term=term,
            flags=flags,
        ),
        clipped=_clipped_columns(g.clipped[order], g.has_clipped[order], scales, p),
        has_dots=np.zeros(len(held), dtype=bool),
        dot_pre_post=zeros,
        dot_pre_pre=zeros,
        has_update=np.zeros(len(held), dtype=bool),
        update_sum_sq=zeros,
        numel=np.ones(len(held), dtype=np.int64),
        distinct_layouts=bool(np.unique(layout).size == layout.size),
        calls=_call_columns([h for h, _ in held], g.clips, p),
    )
    names = [group.param for group in live.groups]
    params = [names[h.group] for h, _ in held]
    return table, _replica_sets(table, params, dtypes, g.coords[order, 0])


def _call_columns(held: list[_Held], clips: Mapping[int, ClipRecord], p: float) -> tuple[KindColumns, ...]:
    """Per clip call, each entry's statistics just before it, as measuring the guard's dump gives
    them from the pieces' per-call statistics."""
    import numpy as np

    rows = np.zeros((len(held), max((len(h.calls) for h in held), default=0), 8))
    for i, h in enumerate(held):
        calls = clips[h.rank].calls
        for call, term in enumerate(h.calls):
            scale = call_scale(calls[call]) if call < len(calls) else 1.0
            rows[i, call] = call_row(_one_element(term, p), p, scale)
    return call_columns(rows)


def _unscaled_columns(
    sums: np.ndarray, scales: np.ndarray, p: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sum |x|^p, sum x^2, max |x|) of these [n, 3] sums, each divided by its rank's loss scale as
    measuring the guard's dump divides them (measurements.unscaled_sums, by rank)."""
    import numpy as np

    sum_pow, sum_sq, max_abs = (np.array(sums[:, i], dtype=np.float64) for i in range(3))
    for scale in np.unique(scales[scales != 1.0]).tolist():
        at = scales == scale
        sum_pow[at], sum_sq[at], max_abs[at] = unscaled_sums(sum_pow[at], sum_sq[at], max_abs[at], scale, p)
    return sum_pow, sum_sq, max_abs


def _clipped_columns(sums: np.ndarray, has: np.ndarray, scales: np.ndarray, p: float) -> KindColumns | None:
    """The clipped gradient's columns (UNKNOWN where a group has none); None when no group has one."""
    import numpy as np

    if not has.any():
        return None
    sum_pow, sum_sq, max_abs = _unscaled_columns(sums, scales, p)
    return KindColumns(
        has=has,
        sum_sq=np.where(has, sum_sq, 0.0),
        max_abs=np.where(has, max_abs, 0.0),
        counts=np.zeros((has.size, 3), dtype=np.int64),
        term=np.where(has, max_abs if math.isinf(p) else sum_pow, 0.0),
        flags=np.where(has, 0, UNKNOWN).astype(np.int8),
    )


def _replica_sets(
    table: StepTable, params: list[str], dtypes: list[str], positions: np.ndarray
) -> dict[str, tuple[ReplicaSet, ...]]:
    """Parameter -> its groups held on several ranks, each copy compared with the lowest rank's as
    measuring the guard's dump compares statistics-only copies (their sums, their nonfinite counts):
    the sets found and every copy's difference taken for all entries at once."""
    import numpy as np

    grad, order = table.grad, table.by_rank_order
    chosen = order[np.bincount(table.layout)[table.layout[order]] > 1]  # copies of a layout, by rank
    entries = chosen[np.argsort(table.layout[chosen], kind="stable")]  # by layout, each by rank
    layout = table.layout[entries]
    starts = np.flatnonzero(np.concatenate(([True], layout[1:] != layout[:-1]))) if entries.size else entries
    bases = entries[starts]
    base_of = np.repeat(bases, np.diff(np.append(starts, entries.size)))
    root = np.sqrt(grad.sum_sq)
    by_sum = np.abs(root[entries] - root[base_of])
    by_max = np.abs(grad.max_abs[entries] - grad.max_abs[base_of])
    delta = np.where(by_max > by_sum, by_max, by_sum)  # max(by_sum, by_max), as Python's max takes it
    delta = np.where(grad.nonfinite[entries] != grad.nonfinite[base_of], math.inf, delta)
    rank, index = table.rank.tolist(), table.index.tolist()
    max_abs, sum_sq, at = grad.max_abs.tolist(), grad.sum_sq.tolist(), positions.tolist()
    ids, deltas, bounds = entries.tolist(), delta.tolist(), [*starts.tolist(), entries.size]
    found: dict[str, list[ReplicaSet]] = {}
    for k in np.lexsort((table.index[bases], table.rank[bases])).tolist():
        first, past = bounds[k], bounds[k + 1]
        base = ids[first]
        found.setdefault(params[base], []).append(
            ReplicaSet(
                param=params[base],
                regions=(FlatRange(start=at[base], stop=at[base] + 1),),
                dtype=dtypes[base],
                base_rank=rank[base],
                base_index=index[base],
                base_max_abs=max_abs[base],
                base_sum_sq=sum_sq[base],
                numel=1,
                copies=tuple(
                    ReplicaCopy(rank=rank[ids[j]], index=index[ids[j]], fingerprint_delta=deltas[j])
                    for j in range(first + 1, past)
                ),
                by_values=False,
            )
        )
    return {name: tuple(sets) for name, sets in found.items()}


def _class_of(live: LiveStep, group: OwnershipGroup, summary: RankSummary) -> tuple[int, ...]:
    """The ranks whose pieces of `group` are replicas of this rank's: the replica group's rank list."""
    if group.replica_group is None:
        return (summary.rank,)
    members = summary.topology.group_of(group.replica_group, summary.rank)
    return members if members else (summary.rank,)


def _classes(live: LiveStep) -> list[dict[int, tuple[int, ...]]]:
    """Per group: each rank holding it -> its replica class (see `_class_of`)."""
    return [
        {rank: _class_of(live, group, s) for rank, s in live.ranks.items() if s.held[i]}
        for i, group in enumerate(live.groups)
    ]


def _layouts(classes: list[dict[int, tuple[int, ...]]]) -> list[dict[tuple[int, ...], int]]:
    """Per group: each replica class -> its element in the group's one-dimensional parameter."""
    return [{members: n for n, members in enumerate(sorted(set(of.values())))} for of in classes]


def _one_element(term: float, norm_type: float, *, num_nan: int = 0, num_inf: int = 0) -> TensorStats:
    """Statistics of one element whose magnitude is the group's norm: sum |x|^p is the group's term."""
    sum_pow, sum_sq, max_abs = _sums(term, norm_type)
    return TensorStats(
        numel=1,
        norm_type=norm_type,
        sum_pow=sum_pow,
        sum_sq=sum_sq,
        max_abs=max_abs,
        num_nan=num_nan,
        num_posinf=num_inf,
    )


def _clip_records(live: LiveStep) -> dict[int, ClipRecord]:
    """Rank -> its clip record; one object for the ranks whose records are equal (most of them)."""
    found: dict[tuple[object, ...], ClipRecord] = {}
    records = {}
    for rank, s in live.ranks.items():
        key = (
            s.loss_scale,
            s.unscaled,
            s.skipped,
            *((c.reported_norm, c.max_norm, c.norm_type) for c in s.calls),
        )
        records[rank] = found.get(key) or found.setdefault(key, _clip_record(live, s))
    return records


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
    pipeline's last stage (audit.build_report), as audit.audit_step_dir runs it without a reference."""
    from ..audit import build_report, command_for
    from ..checks.base import AuditOptions
    from ..dumpfile.loader import gc_paused
    from ..measure.measure import overflow_notes

    with gc_paused():  # as audit_step_dir: a many-rank step is many small objects, all kept alive
        inputs = analysis_of(live)
        options = AuditOptions()
        command = command_for(live.directory, options) if live.directory else ""
        return build_report(inputs, options, command=command, warnings=overflow_notes(inputs.table))
