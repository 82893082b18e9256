"""Which norm did the training code use? The true global norm, the norms common mistakes produce,
and the match of each rank's reported norm against them (pure: works on measurements only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from .measure import PieceMeasurement, StepMeasurements
from .model import StepDump, TensorStats
from .norms import CLIP_EPS, expected_clip_coef, is_inf_norm, norm_of_terms, norm_rtol, relative_difference

MIN_RTOL = 1e-6
"""The tightest tolerance for matching numbers the training code computed: even with float64
gradients, norms and coefficients are often computed or logged in float32."""

CORRECT = "correct"
LOCAL_ONLY = "local_only"
DOUBLE_COUNTED = "replicas_double_counted"
WRONG_GROUP = "wrong_group"
LOSS_SCALED = "loss_scaled"
UNEXPLAINED = "unexplained"


def stats_term(stats: TensorStats, norm_type: float) -> float | None:
    """The piece's term of the p-norm (sum |x|^p, or max |x| for inf); None when the stats lack it."""
    if is_inf_norm(norm_type):
        return stats.max_abs
    if stats.norm_type == norm_type:
        return stats.sum_pow
    if norm_type == 2.0:
        return stats.sum_sq
    return None


def norm_of_pieces(pieces: Iterable[PieceMeasurement], norm_type: float, kind: str = "grad") -> float | None:
    """The p-norm of the given pieces, each counted as given; nan if any holds a nan, inf if any an inf.

    Pieces without the kind count as zero (a parameter without gradient); None when a piece's stats
    were taken for another norm type and cannot give this one.
    """
    terms, has_nan, has_inf = [], False, False
    for piece in pieces:
        stats = piece.stats.get(kind)
        if stats is None:
            continue
        term = stats_term(stats, norm_type)
        if term is None:
            return None
        terms.append(term)
        has_nan |= stats.num_nan > 0
        has_inf |= (stats.num_posinf + stats.num_neginf) > 0
    if has_nan:
        return math.nan
    if has_inf:
        return math.inf
    return norm_of_terms(terms, norm_type)


def disjoint_cover(pieces: Iterable[PieceMeasurement]) -> list[PieceMeasurement]:
    """One piece per layout: replicas count once, through their lowest-rank copy."""
    chosen: dict[tuple, PieceMeasurement] = {}
    for piece in sorted(pieces, key=lambda p: (p.rank, p.index)):
        chosen.setdefault(piece.layout_key, piece)
    return list(chosen.values())


def has_replicas(pieces: Iterable[PieceMeasurement]) -> bool:
    seen = set()
    for piece in pieces:
        if piece.layout_key in seen:
            return True
        seen.add(piece.layout_key)
    return False


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A norm some accounting (correct or mistaken) produces from this step's pieces."""

    hypothesis: str
    value: float
    description: str


@dataclass(frozen=True, kw_only=True)
class Match:
    """What a rank's number (reported, or implied by its coefficient) matched, within tolerance."""

    observed: float
    what: str
    """"reported norm" or "norm implied by the applied coefficient"."""
    candidate: Candidate | None
    coinciding: tuple[str, ...] = ()
    """Other hypotheses that give the same number within tolerance: they cannot be told apart."""

    @property
    def hypothesis(self) -> str:
        return UNEXPLAINED if self.candidate is None else self.candidate.hypothesis


@dataclass(frozen=True, kw_only=True)
class RankDiagnosis:
    rank: int
    local_norm: float | None
    reported_norm: float | None
    applied_coef: float | None
    coef_source: str | None
    implied_norm: float | None
    candidates: tuple[Candidate, ...]
    reported_match: Match | None
    implied_match: Match | None
    hypothesis: str | None
    """What the clipping (or, with `logging_bug`, the logging) used; None when nothing to match."""
    detail: str
    logging_bug: bool = False
    share_of_squared_norm: float = 0.0
    rtol: float = 1e-4


@dataclass(frozen=True, kw_only=True)
class StepDiagnosis:
    norm_type: float
    max_norm: float | None
    true_norm: float | None
    true_norm_note: str
    """Why the true norm is unknown, or "" when known."""
    expected_coef: float | None
    loss_scale: float | None
    rtol: float
    ranks: Mapping[int, RankDiagnosis] = field(default_factory=dict)
    post_clip_norm: float | None = None


def loss_scale_of(step: StepDump) -> float | None:
    for rank in step.ranks_present:
        clip = step.ranks[rank].clip
        if clip is None:
            continue
        if clip.loss_scale is not None:
            return clip.loss_scale
        for call in clip.calls:
            if call.loss_scale is not None:
                return call.loss_scale
    return None


def reported_norm_of(step: StepDump, rank: int) -> float | None:
    clip = step.ranks[rank].clip
    if clip is None:
        return None
    if clip.reported_norm is not None:
        return clip.reported_norm
    for call in reversed(clip.calls):
        if call.reported_norm is not None:
            return call.reported_norm
    return None


def applied_coef_of(step: StepDump, rank: int, pieces: list[PieceMeasurement], max_norm: float | None) -> tuple[float | None, str | None]:
    """The coefficient this rank applied, and where it comes from: "gradients", "reported" or "reported_norm"."""
    pre_post = [(p.dot_pre_post, p.dot_pre_pre) for p in pieces if p.dot_pre_post is not None]
    if pre_post:
        denominator = math.fsum(b for _, b in pre_post)
        if denominator > 0:
            return math.fsum(a for a, _ in pre_post) / denominator, "gradients"
    stat_pairs = [(p.stats["grad"], p.stats["grad_clipped"]) for p in pieces if "grad" in p.stats and "grad_clipped" in p.stats]
    if stat_pairs and len(stat_pairs) == len([p for p in pieces if "grad" in p.stats]):
        pre = math.fsum(a.sum_sq for a, _ in stat_pairs)
        post = math.fsum(b.sum_sq for _, b in stat_pairs)
        if pre > 0:
            return math.sqrt(post / pre), "gradients"
    clip = step.ranks[rank].clip
    if clip is not None and clip.clip_coef is not None:
        return clip.clip_coef, "reported"
    reported = reported_norm_of(step, rank)
    if reported is not None and max_norm is not None:
        return expected_clip_coef(reported, max_norm), "reported_norm"
    return None, None


def _candidates(
    step: StepDump,
    rank: int,
    by_rank: Mapping[int, list[PieceMeasurement]],
    norm_type: float,
    true_norm: float | None,
    loss_scale: float | None,
    cache: dict,
) -> tuple[Candidate, ...]:
    complete = not step.missing_ranks

    def value(ranks: tuple[int, ...], dedupe: bool) -> float | None:
        key = (ranks, dedupe)
        if key not in cache:
            pieces = [p for r in ranks for p in by_rank.get(r, ())]
            cache[key] = norm_of_pieces(disjoint_cover(pieces) if dedupe else pieces, norm_type)
        return cache[key]

    all_ranks = tuple(step.ranks_present)
    found: list[Candidate] = []
    signatures: set = set()

    def add(hypothesis: str, ranks: tuple[int, ...], dedupe: bool, description: str, norm: float | None = None) -> None:
        signature = (frozenset(ranks), dedupe)
        if signature in signatures:
            return
        norm = value(ranks, dedupe) if norm is None else norm
        if norm is None:
            return
        signatures.add(signature)
        found.append(Candidate(hypothesis=hypothesis, value=norm, description=description))

    if true_norm is not None:
        add(CORRECT, all_ranks, True, "every logical element counted once", true_norm)
    add(LOCAL_ONLY, (rank,), False, f"rank {rank}'s own pieces only")
    all_pieces = [p for r in all_ranks for p in by_rank.get(r, ())]
    if complete and has_replicas(all_pieces):
        add(DOUBLE_COUNTED, all_ranks, False, "all ranks' pieces, every replica counted")
    groups = sorted(
        ((name, step.topology.group_of(name, rank)) for name in step.topology.groups),
        key=lambda g: (len(g[1] or ()), g[0]),
    )
    for name, members in groups:
        if not members or any(m in step.missing_ranks for m in members):
            continue
        members = tuple(sorted(members))
        if set(members) == set(range(step.world_size)) or members == (rank,):
            continue
        add(f"{WRONG_GROUP}:{name}", members, True, f"ranks {list(members)} of group {name}, replicas once")
        group_pieces = [p for r in members for p in by_rank.get(r, ())]
        if has_replicas(group_pieces):
            add(f"{WRONG_GROUP}:{name}", members, False, f"ranks {list(members)} of group {name}, every replica counted")
    if loss_scale is not None and loss_scale not in (0.0, 1.0) and math.isfinite(loss_scale):
        found.extend(
            Candidate(
                hypothesis=f"{LOSS_SCALED}:{c.hypothesis}",
                value=c.value * loss_scale,
                description=f"{c.description}, times the loss scale {loss_scale:g}",
            )
            for c in list(found)
        )
    return tuple(found)


def match_norm(observed: float, what: str, candidates: tuple[Candidate, ...], rtol: float) -> Match:
    """The first candidate (in order of plausibility) within `rtol` of the observed number."""
    close = [c for c in candidates if relative_difference(observed, c.value) <= rtol]
    if not close:
        return Match(observed=observed, what=what, candidate=None)
    best = close[0]
    coinciding = tuple(dict.fromkeys(c.hypothesis for c in close[1:] if c.hypothesis != best.hypothesis))
    return Match(observed=observed, what=what, candidate=best, coinciding=coinciding)


def _implied_norm(coef: float | None, max_norm: float | None, rtol: float) -> float | None:
    """The norm a coefficient below 1 was computed from: max_norm / coef - 1e-6."""
    if coef is None or max_norm is None or not (0 < coef < 1 - rtol) or not math.isfinite(coef):
        return None
    return max_norm / coef - CLIP_EPS


def _decide(reported: Match | None, implied: Match | None) -> tuple[str | None, bool, str]:
    """(hypothesis, logging_bug, detail) from the two matches; the applied coefficient shows what clipping used."""
    if reported is None and implied is None:
        return None, False, "no reported norm and no applied coefficient below 1 to match"
    if implied is None:
        return reported.hypothesis, False, _describe(reported)
    if reported is None:
        return implied.hypothesis, False, _describe(implied)
    if reported.hypothesis == implied.hypothesis:
        return reported.hypothesis, False, _describe(reported)
    if implied.hypothesis == CORRECT:
        return reported.hypothesis, True, _describe(reported) + "; but the applied coefficient matches the true norm"
    return implied.hypothesis, False, _describe(implied) + f"; the reported norm says {reported.hypothesis}"


def _describe(match: Match) -> str:
    if match.candidate is None:
        return f"{match.what} {match.observed:.6g} matches no known accounting"
    text = f"{match.what} {match.observed:.6g} matches {match.candidate.description} ({match.candidate.value:.6g})"
    if match.coinciding:
        text += f"; indistinguishable here from {', '.join(match.coinciding)}"
    return text


def diagnose_step(step: StepDump, m: StepMeasurements) -> StepDiagnosis:
    """The true global norm, the expected coefficient, and every present rank's diagnosis."""
    norm_type = m.norm_type
    clip = step.clip
    max_norm = None if clip is None else clip.max_norm
    all_pieces = list(m.pieces)
    by_rank: dict[int, list[PieceMeasurement]] = {}
    for piece in all_pieces:
        by_rank.setdefault(piece.rank, []).append(piece)
    cover = disjoint_cover(all_pieces)
    true_norm, note = norm_of_pieces(cover, norm_type), ""
    if true_norm is None:
        note = f"the dumped statistics were taken for another norm type than {norm_type:g}"
    elif step.missing_ranks and not _covers_every_param(step, cover):
        true_norm, note = None, f"ranks {list(step.missing_ranks)} are missing and held parts of the gradient"
    post_clip = None
    if all("grad_clipped" in p.stats for p in cover if "grad" in p.stats) and cover and true_norm is not None:
        post_clip = norm_of_pieces(cover, norm_type, kind="grad_clipped")
    expected = None if true_norm is None or max_norm is None else expected_clip_coef(true_norm, max_norm)
    rtol = max(norm_rtol({p.dtype for p in all_pieces}), MIN_RTOL)
    loss_scale = loss_scale_of(step)
    total_sq = math.fsum(p.stats["grad"].sum_sq for p in cover if "grad" in p.stats)
    cache: dict = {}
    ranks = {}
    for rank in step.ranks_present:
        own = by_rank.get(rank, [])
        candidates = _candidates(step, rank, by_rank, norm_type, true_norm, loss_scale, cache)
        reported = reported_norm_of(step, rank)
        coef, source = applied_coef_of(step, rank, own, max_norm)
        implied = _implied_norm(coef, max_norm, rtol) if source != "reported_norm" else None
        reported_match = None if reported is None else match_norm(reported, "reported norm", candidates, rtol)
        implied_match = None if implied is None else match_norm(implied, "norm implied by the applied coefficient", candidates, rtol)
        hypothesis, logging_bug, detail = _decide(reported_match, implied_match)
        own_sq = math.fsum(p.stats["grad"].sum_sq for p in cover if p.rank == rank and "grad" in p.stats)
        ranks[rank] = RankDiagnosis(
            rank=rank,
            local_norm=norm_of_pieces(own, norm_type),
            reported_norm=reported,
            applied_coef=coef,
            coef_source=source,
            implied_norm=implied,
            candidates=candidates,
            reported_match=reported_match,
            implied_match=implied_match,
            hypothesis=hypothesis,
            detail=detail,
            logging_bug=logging_bug,
            share_of_squared_norm=own_sq / total_sq if total_sq > 0 else 0.0,
            rtol=rtol,
        )
    return StepDiagnosis(
        norm_type=norm_type,
        max_norm=max_norm,
        true_norm=true_norm,
        true_norm_note=note,
        expected_coef=expected,
        loss_scale=loss_scale,
        rtol=rtol,
        ranks=ranks,
        post_clip_norm=post_clip,
    )


def _covers_every_param(step: StepDump, cover: list[PieceMeasurement]) -> bool:
    """Whether the present ranks' distinct pieces hold as many elements as every parameter has
    (the exact overlap/gap check is GA102/GA103; this only tells whether missing ranks mattered)."""
    held: dict[str, int] = {}
    for piece in cover:
        held[piece.param] = held.get(piece.param, 0) + piece.numel
    return all(held.get(name, 0) >= info.numel for name, info in step.params.items())
