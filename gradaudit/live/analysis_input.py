"""The boundary between the guard and the analysis: the per-rank summary every rank gathered, turned
into the analysis' input, so that the guard's verdict and `gradaudit check` come from one diagnosis.

The diagnosis reads the summary directly: `norm_input` makes it the diagnosis' own input
(`analysis.norm_input.NormInput`: one entry per rank and ownership group it holds, replicas of a group
sharing a layout, so every accounting the diagnosis tries gives the number it would from the real
pieces). The other checks read a stats-mode dump, which the guard also writes on an anomaly: one
`RankDump` per rank whose pieces are the rank's ownership groups, each a one-element piece whose
value is the group's norm (`rank_dumps`); `report_of` runs the offline stages on the two
(`measure_step` -> `audit.analyse` -> `audit.build_report`, as `audit.audit_step` assembles them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

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
from ..norms import divide_by_power

if TYPE_CHECKING:
    from ..analysis.norm_input import NormInput
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
    of the diagnosis' input are made of: its replica class's element (`position`) in the group's
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


def rank_dumps(live: LiveStep) -> dict[int, RankDump]:
    """The stats-mode rank dumps the live step amounts to (what the guard writes on an anomaly)."""
    layouts, p, held = _layouts(live), live.norm_type, _held(live)
    params = tuple(
        ParamInfo(name=g.param, global_shape=(len(layouts[i]),), dtype=g.dtype)
        for i, g in enumerate(live.groups)
        if layouts[i]
    )
    dumps = {}
    for rank, summary in sorted(live.ranks.items()):
        pieces: list[Piece] = []
        for h in held[rank]:
            group = live.groups[h.group]
            stats: dict[TensorKind, TensorStats] = {
                "grad": _one_element(h.term, p, num_nan=h.num_nan, num_inf=h.num_inf)
            }
            if h.clipped is not None:
                stats["grad_clipped"] = _one_element(h.clipped, p)
            pieces.append(
                Piece(
                    index=len(pieces),
                    param=group.param,
                    regions=(FlatRange(start=h.position, stop=h.position + 1),),
                    local_shape=(1,),
                    dtype=summary.grad_dtype or group.dtype,
                    replica_group=group.replica_group,
                    stats=stats,
                    call_stats=tuple(_one_element(term, p) for term in h.calls),
                )
            )
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


def norm_input(live: LiveStep) -> NormInput:
    """The diagnosis' input from the gathered summary: one entry per rank and ownership group it
    holds, the replicas of a group on one layout (the entries of `rank_dumps`' pieces, read without
    their statistics)."""
    import numpy as np

    from ..analysis.norm_input import Entries, NormInput
    from ..norms import INF, NAN, UNKNOWN, safe_fsum

    layouts, p, raw = _layouts(live), live.norm_type, _held(live)
    scales = {r: _gradient_scale(live, r) for r in raw}
    by_rank = {r: _unscaled(own, scales[r], p) for r, own in raw.items()}
    held = [h for own in by_rank.values() for h in own]
    sum_sq = [divide_by_power(_square(h.term, p), scales[h.rank], 2.0) for own in raw.values() for h in own]
    offsets = np.cumsum([0, *(len(classes) for classes in layouts)]).tolist()
    params = [i for i, classes in enumerate(layouts) if classes]
    at = [(h.rank, offsets[h.group] + h.position) for h in held]  # (rank, layout) of each entry
    coefs = {}
    for r, own in raw.items():  # what measuring the dump's pieces gives

        def squares(terms: list[float], scale: float = scales[r]) -> float:
            return safe_fsum(divide_by_power(_square(t, p), scale, 2.0) for t in terms)

        pre = squares([h.term for h in own])
        if own and all(h.clipped is not None for h in own) and pre > 0:
            coefs[r] = math.sqrt(squares([h.clipped or 0.0 for h in own]) / pre)
    clipped = [
        (*a, h.clipped or 0.0, UNKNOWN if h.clipped is None else 0) for a, h in zip(at, held, strict=True)
    ]
    return NormInput(
        norm_type=p,
        grad=Entries.of(
            [
                (*a, h.term, (NAN if h.num_nan else 0) | (INF if h.num_inf else 0))
                for a, h in zip(at, held, strict=True)
            ]
        ),
        param=np.array([params.index(h.group) for h in held], dtype=np.int64),
        param_names=tuple(live.groups[i].param for i in params),
        sum_sq=np.array(sum_sq, dtype=np.float64),
        clipped=None if all(h.clipped is None for h in held) else Entries.of(clipped),
        calls=tuple(
            Entries.of([(*a, h.calls[call], 0) for a, h in zip(at, held, strict=True) if len(h.calls) > call])
            for call in range(max((len(h.calls) for h in held), default=0))
        ),
        dtypes=frozenset(live.ranks[h.rank].grad_dtype or live.groups[h.group].dtype for h in held),
        measured_coef=coefs,
        drifted=_drifted(raw, p),
    )


def _drifted(by_rank: Mapping[int, list[_Held]], p: float) -> frozenset[int]:
    """Ranks whose copy of a replicated group differs from its lowest rank's copy: what comparing
    the replicas of the guard's dump gives (the one element's magnitude, its nonfinite count)."""
    base: dict[tuple[int, int], tuple[float, int]] = {}
    found = set()
    for rank, own in sorted(by_rank.items()):
        for h in own:
            copy = (_one_element(h.term, p).max_abs, h.num_nan + h.num_inf)
            if base.setdefault((h.group, h.position), copy) != copy:
                found.add(rank)
    return frozenset(found)


def _gradient_scale(live: LiveStep, rank: int) -> float:
    """How many times the true gradient the rank's measured gradients are: the rule loading the
    guard's dump applies to its clip record (the loss scale when clipping ran before unscale_)."""
    from ..measure.measurements import gradient_scale_of

    return gradient_scale_of(_clip_record(live, live.ranks[rank]))


def _unscaled(held: list[_Held], scale: float, p: float) -> list[_Held]:
    """`held` with `scale` divided out of every term, as loading the dump divides it out."""
    if scale == 1.0:
        return held

    def divided(term: float) -> float:
        return term / scale if math.isinf(p) else divide_by_power(term, scale, p)

    return [
        h._replace(
            term=divided(h.term),
            clipped=None if h.clipped is None else divided(h.clipped),
            calls=tuple(divided(t) for t in h.calls),
        )
        for h in held
    ]


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


def _square(term: float, norm_type: float) -> float:
    """sum x^2 of the one element whose term of the p-norm is `term`."""
    return _one_element(term, norm_type).sum_sq


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
    """The report `gradaudit check` gives for the live step: the offline pipeline's own stages
    (measure_step -> audit.analyse -> audit.build_report), as audit.audit_step runs them without a
    reference, on the step the guard's dump amounts to, the diagnosis reading `norm_input(live)`."""
    from ..audit import analyse, build_report, command_for
    from ..checks.base import AuditOptions
    from ..dumpfile.reader import TensorReader
    from ..measure.leftout import checked_params
    from ..measure.measure import measure_step, overflow_notes

    step = step_dump(live)
    options = AuditOptions()
    with TensorReader(step) as reader:
        measurements = measure_step(step, reader, params=checked_params(step), workers=1)
    inputs = analyse(step, measurements, update_judgements={}, terms=norm_input(live))
    command = command_for(live.directory, options) if live.directory else ""
    return build_report(inputs, options, command=command, warnings=overflow_notes(inputs.table))
