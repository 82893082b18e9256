"""Which norm did the training code use? The true global norm, the norms common mistakes produce,
and the match of each rank's reported norm against them (pure: works on measurements only).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..model import StepFacts
from ..norms import (
    CLIP_EPS,
    INF,
    NAN,
    UNKNOWN,
    expected_clip_coef,
    is_inf_norm,
    norm_rtol,
    relative_difference,
)
from ..ranksets import compact_ranks
from .hypotheses import (
    CORRECT,
    DOUBLE_COUNTED,
    LOCAL_ONLY,
    UNEXPLAINED,
    WRONG_GROUP,
    Candidate,
    Hypothesis,
    NormOf,
    ParamGroup,
    ParamTerms,
    averaged_candidates,
    every_copy_candidates,
    group_candidates,
    groups_of,
    listed_twice_candidates,
    overflow_candidates,
    per_param_group_candidates,
)
from .norm_input import Entries, NormInput, NormSet, param_signatures, shares_of_squared_norm

GROUP_PIECES_API = "guard"
"""The capture API whose entries are a rank's ownership groups (the guard's summary and its dump), not
parameters: no hypothesis about one parameter can be named from them."""

MIN_RTOL = 1e-6
"""The tightest tolerance for matching numbers the training code computed: even with float64
gradients, norms and coefficients are often computed or logged in float32."""


@dataclass(frozen=True, kw_only=True)
class Match:
    """What a rank's number (reported, or implied by its coefficient) matched, within tolerance."""

    observed: float
    what: str
    """"reported norm" or "norm implied by the applied coefficient"."""
    candidate: Candidate | None
    coinciding: tuple[Hypothesis, ...] = ()
    """Other hypotheses that give the same number within tolerance: they cannot be told apart."""

    @property
    def hypothesis(self) -> Hypothesis:
        return UNEXPLAINED if self.candidate is None else self.candidate.hypothesis


@dataclass(frozen=True, kw_only=True)
class RankDiagnosis:
    """Which norm one rank's clipping used, from its reported norm and its applied coefficient."""

    rank: int
    local_norm: float | None
    """The norm of this rank's own pieces only."""
    reported_norm: float | None
    """The norm the rank's training code reported (of its last clip call)."""
    applied_coef: float | None
    """The clip coefficient the rank applied, measured or reported."""
    coef_source: str | None
    """Where `applied_coef` comes from: "gradients", "reported" or "reported_norm"."""
    implied_norm: float | None
    """The norm a coefficient below 1 was computed from (max_norm / coef - eps)."""
    candidates: tuple[Candidate, ...]
    """Every norm an accounting (right or mistaken) gives for this rank, in order of plausibility."""
    reported_match: Match | None
    implied_match: Match | None
    hypothesis: Hypothesis | None
    """What the clipping (or, with `logging_bug`, the logging) used; None when nothing to match."""
    detail: str
    """One sentence saying what matched what, for the report's rank rows."""
    logging_bug: bool = False
    """The reported norm is wrong but the applied coefficient matches the true norm (GA205)."""
    share_of_squared_norm: float = 0.0
    """This rank's part of the squared true norm (its pieces in the disjoint cover)."""
    rtol: float = 1e-4
    """The tolerance the matches used (by the dumped dtypes)."""
    true_norm: float | None = None
    """The true global norm as this rank's data gives it: its own copies of replicated pieces, which
    differ from the lowest rank's only when replicas drifted apart (GA601)."""
    expected_coef: float | None = None
    """The coefficient clipping by `true_norm` gives."""
    num_clip_calls: int = 0


@dataclass(frozen=True, kw_only=True)
class StepDiagnosis:
    """The analysis of one step's norm: the truth, and each present rank's diagnosis."""

    norm_type: float
    max_norm: float | None
    true_norm: float | None
    """Every logical element counted once (replicas through the lowest rank); None when unknown."""
    true_norm_note: str
    """Why the true norm is unknown, or "" when known."""
    expected_coef: float | None
    loss_scale: float | None
    """The AMP loss scale any rank recorded."""
    rtol: float
    ranks: Mapping[int, RankDiagnosis] = field(default_factory=dict)
    post_clip_norm: float | None = None
    """The global norm after clipping; with ranks missing (`norm_lower_bound` set), a lower bound."""
    num_clip_calls: int = 0
    """The most clip calls any rank made before its optimizer step."""
    moment: str = ""
    """When the dumped pre-clip gradient was taken, when that is not simply "before clipping": e.g.
    "before the last of 2 clip calls". Every norm derived from it is of that moment."""
    mixed_moments: bool = False
    """The pre-clip gradient is from before the first of several clip calls and the post-clip one
    from after the last (a dump without per-call evidence): nothing may be derived across the two."""
    call_norms: tuple[CallNorm, ...] = ()
    """The true global norm just before each clip call, from the per-call statistics."""
    norm_lower_bound: float | None = None
    """With ranks missing: the norm of what the present ranks hold, a lower bound on the true norm."""

    @property
    def coef_upper_bound(self) -> float | None:
        """With ranks missing: the largest coefficient the lower bound on the norm allows."""
        return expected_coef_of(self.norm_lower_bound, self.max_norm)


@dataclass(frozen=True, kw_only=True)
class CallNorm:
    """The true global norm of the gradient just before one clip call (1-based `call`)."""

    call: int
    norm: float | None
    replicas_differ: bool = False
    """Copies of replicated pieces differed at this call (not yet reduced): the lowest rank's count."""


def loss_scale_of(step: StepFacts) -> float | None:
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


def reported_norm_of(step: StepFacts, rank: int) -> float | None:
    clip = step.ranks[rank].clip
    if clip is None:
        return None
    if clip.reported_norm is not None:
        return clip.reported_norm
    for call in reversed(clip.calls):
        if call.reported_norm is not None:
            return call.reported_norm
    return None


def _applied_coef(
    step: StepFacts, rank: int, norms: NormInput, max_norm: float | None
) -> tuple[float | None, str | None]:
    """The coefficient this rank applied, and where it comes from: "gradients", "reported" or "reported_norm"."""
    if rank in norms.measured_coef:
        return norms.measured_coef[rank], "gradients"
    clip = step.ranks[rank].clip
    if clip is not None and clip.clip_coef is not None:
        return clip.clip_coef, "reported"
    reported = reported_norm_of(step, rank)
    if reported is not None and max_norm is not None:
        return expected_clip_coef(reported, max_norm), "reported_norm"
    return None, None


_Signature = tuple[frozenset[int], str]
"""A candidate's identity: the ranks whose entries it counts and how ("once": replicas once, "every":
every copy, "per_member": the ranks' norm once per member)."""
_Signed = tuple[_Signature, Candidate]
_OfGroup = tuple[tuple[int, ...], tuple[_Signed, ...]]
"""(a group's members, sorted, and its wrong-group candidates)."""
_WithScaled = tuple[tuple[Candidate, ...], tuple[Candidate, ...]]
"""(candidates, their loss-scaled copies)."""


class _StepWide:
    """What the candidates of every rank share, computed once per step: the set of all ranks, their
    norm with every replica counted, each process group's members, sorted, and the candidates that
    name no single rank (the true norm's, each group's, their loss-scaled copies), each built once
    and shared by every rank it applies to (a many-rank step would otherwise build them per rank)."""

    def __init__(self, step: StepFacts, norms: NormSet) -> None:
        self.all_ranks = tuple(step.ranks_present)
        self.everyone = frozenset(self.all_ranks)
        self.double, self.repeated = norms.norm(self.all_ranks, False)
        self._world = frozenset(range(step.world_size))
        self._missing = frozenset(step.missing_ranks)
        self._norms = norms
        self._num_layouts: int | None = None
        self._holds_everything: dict[int, bool] = {}
        self._topology, self._names = step.topology, tuple(step.topology.groups)
        self._of_group: dict[tuple[str, int], _OfGroup] = {}
        self._scaled: dict[int, tuple[Candidate, Candidate]] = {}
        self._tails: dict[tuple[tuple[str, int], ...], _WithScaled] = {}
        self.first: tuple[_Signed, ...] = ()
        """The true norm's candidate, first of every rank's."""
        self.double_counted: tuple[_Signed, ...] = ()
        """The candidate counting every copy of every rank's pieces (after the rank's own)."""
        self.loss_scale: float | None = None
        """The loss scale every candidate is tried multiplied by, when one applies."""
        self.ids: set[int] = set()
        """The ids of the candidates above, each group's and the loss-scaled ones (all kept alive)."""
        if not step.missing_ranks and self.repeated and self.double is not None:
            double = Candidate(
                hypothesis=DOUBLE_COUNTED,
                value=self.double,
                description="all ranks' pieces, every replica counted",
            )
            self.double_counted = (((self.everyone, "every"), double),)
            self.ids.add(id(double))

    def know(self, true_norm: float | None, loss_scale: float | None) -> None:
        """The true norm and the loss scale, once known: the candidates every rank shares."""
        if true_norm is not None:
            correct = Candidate(
                hypothesis=CORRECT, value=true_norm, description="every logical element counted once"
            )
            self.first = (((self.everyone, "once"), correct),)
            self.ids.add(id(correct))
        if loss_scale is not None and loss_scale not in (0.0, 1.0) and math.isfinite(loss_scale):
            self.loss_scale = loss_scale

    def holds_everything(self, members: tuple[int, ...]) -> bool:
        """Whether the ranks of this topology group hold every element of the step (some copy of every
        layout); `members`: the topology's own tuple, the same object for every rank of the group."""
        key = id(members)
        if key not in self._holds_everything:
            if self._num_layouts is None:
                self._num_layouts = self._norms.num_layouts(self.all_ranks)
            self._holds_everything[key] = self._norms.num_layouts(members) >= self._num_layouts
        return self._holds_everything[key]

    def groups_of(self, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """The rank's lists of each topology group, smallest first (then by name)."""
        listed = [(name, self._topology.group_of(name, rank)) for name in self._names]
        if len(listed) > 1:
            listed.sort(key=lambda g: (len(g[1] or ()), g[0]))
        return [(name, members) for name, members in listed if members is not None]

    def of_group(self, name: str, listed: tuple[int, ...]) -> _OfGroup:
        """(sorted members, wrong-group candidates) of group `name`'s rank list `listed` (the
        topology's own tuple, holding the rank); no candidates for a group with a missing member or
        of the whole world (not a wrong reduction group)."""
        key = (name, id(listed))
        if key not in self._of_group:
            self._of_group[key] = self._group_candidates(name, listed)
        return self._of_group[key]

    def _group_candidates(self, name: str, listed: tuple[int, ...]) -> _OfGroup:
        member_set, norms = frozenset(listed), self._norms
        if member_set & self._missing or member_set == self._world:
            return (), ()
        members = tuple(sorted(listed))
        found: list[_Signed] = []
        wrong, shown = Hypothesis(kind=WRONG_GROUP, what=name), f"ranks {list(members)} of group {name}"

        def add(counted: str, description: str, value: float | None) -> None:
            if value is not None:
                candidate = Candidate(hypothesis=wrong, value=value, description=description)
                found.append(((member_set, counted), candidate))
                self.ids.add(id(candidate))

        once, repeated = norms.norm(members, True)
        add("once", f"{shown}, replicas once", once)
        if repeated:
            add("every", f"{shown}, every replica counted", norms.norm(members, False)[0])
        norm_type = norms.norm_type
        if (
            once is not None
            and math.isfinite(once)
            and not is_inf_norm(norm_type)  # a max counted once per member is the same max
            and not self.holds_everything(listed)
        ):
            per_member = once * len(members) ** (1.0 / norm_type)
            add("per_member", _per_member(shown, members, once, norm_type), per_member)
        return members, tuple(found)

    def head(self) -> _WithScaled:
        """(the candidates every rank's list starts with, their loss-scaled copies)."""
        first = tuple(c for _, c in self.first)
        return first, tuple(self.scaled(c) for c in first) if self.loss_scale is not None else ()

    def tail(self, rank: int) -> _WithScaled:
        """(the candidates after the rank's own: the double-counted one and those of its groups of
        more than one rank, their loss-scaled copies), built once for all ranks of the same group
        lists. Of the accountings counting the same ranks the same way (one signature), the first
        only, the true norm's included; every copy of one rank's pieces is that rank's local norm."""
        groups = self.groups_of(rank)
        key = tuple((name, id(listed)) for name, listed in groups)
        found = self._tails.get(key)
        if found is None:
            signed = list(self.double_counted)
            for name, listed in groups:
                members, entries = self.of_group(name, listed)
                if len(members) > 1:
                    signed += entries
            seen = {signature for signature, _ in self.first}
            kept: list[Candidate] = []
            for signature, candidate in signed:
                if signature not in seen and not (len(signature[0]) == 1 and signature[1] == "every"):
                    seen.add(signature)
                    kept.append(candidate)
            scaled = tuple(self.scaled(c) for c in kept) if self.loss_scale is not None else ()
            found = self._tails[key] = (tuple(kept), scaled)
        return found

    def scaled(self, candidate: Candidate) -> Candidate:
        """The same accounting of gradients still multiplied by the loss scale (built once per
        shared candidate)."""
        kept = self._scaled.get(id(candidate))
        if kept is not None and kept[0] is candidate:
            return kept[1]
        assert self.loss_scale is not None
        found = _scaled(candidate, self.loss_scale)
        self._scaled[id(candidate)] = (candidate, found)  # the candidate kept alive: its id stays its own
        self.ids.add(id(found))
        return found


def _scaled(c: Candidate, loss_scale: float) -> Candidate:
    return Candidate(
        hypothesis=c.hypothesis.scaled(),
        value=c.value * loss_scale,
        description=f"{c.description}, times the loss scale {loss_scale:g}",
    )


def _candidates(
    rank: int,
    local: float | None,
    true_norm: float | None,
    rank_true: float | None,
    shared: _StepWide,
) -> tuple[Candidate, ...]:
    """Every norm an accounting gives for this rank, in order of plausibility: the true norm's, the
    rank's own, the shared tail's (`_StepWide.tail`), then their loss-scaled copies."""
    own: list[Candidate] = []
    if (
        true_norm is not None
        and rank_true is not None
        and rank_true is not true_norm
        and relative_difference(rank_true, true_norm) > 0
    ):  # drifted replicas
        own.append(
            Candidate(
                hypothesis=CORRECT,
                value=rank_true,
                description=f"every logical element counted once, with rank {rank}'s own drifted replicas",
            )
        )
    if local is not None:
        own.append(
            Candidate(hypothesis=LOCAL_ONLY, value=local, description=f"rank {rank}'s own pieces only")
        )
    head, tail = shared.head(), shared.tail(rank)
    if shared.loss_scale is None:
        return (*head[0], *own, *tail[0])
    scale = shared.loss_scale
    return (*head[0], *own, *tail[0], *head[1], *(_scaled(c, scale) for c in own), *tail[1])


class _Memo:
    """Matches and decisions already made in this step, by what they were made of: ranks that observe
    one number close to the same shared candidates share one Match, and ranks whose two matches are
    shared share one decision (a many-rank step holds a few distinct ones). A match involving a
    rank's own candidate, or of the number 0 (0.0 and -0.0 print apart), is made afresh."""

    def __init__(self, shared: _StepWide) -> None:
        self._shared = shared.ids
        self._matches: dict[tuple[float, str, tuple[int, ...]], Match] = {}
        self._kept: set[int] = set()
        """The ids of the Matches above (kept alive with them)."""
        self._decisions: dict[tuple[int, int, bool], tuple[Hypothesis | None, bool, str]] = {}

    def match(self, observed: float, what: str, candidates: tuple[Candidate, ...], rtol: float) -> Match:
        close = _close(observed, candidates, rtol)
        ids = tuple(map(id, close))
        if observed == 0 or not self._shared.issuperset(ids):
            return _match_of(observed, what, close)
        key = (observed, what, ids)
        found = self._matches.get(key)
        if found is None:
            found = self._matches[key] = _match_of(observed, what, close)
            self._kept.add(id(found))
        return found

    def decide(
        self,
        reported: Match | None,
        implied: Match | None,
        coef_is_one: bool,
        coef: float | None,
        rtol: float,
    ) -> tuple[Hypothesis | None, bool, str]:
        """_decide's answer; `coef` matters only with a candidate giving parameters different
        coefficients (`coef_range`), which no shared candidate does."""
        kept = self._kept
        if any(match is not None and id(match) not in kept for match in (reported, implied)):
            return _decide(reported, implied, coef_is_one, coef, rtol)
        key = (id(reported), id(implied), coef_is_one)
        if key not in self._decisions:
            self._decisions[key] = _decide(reported, implied, coef_is_one, coef, rtol)
        return self._decisions[key]


def expected_coef_of(norm: float | None, max_norm: float | None) -> float | None:
    """expected_clip_coef of a norm and a threshold either of which may be unknown (None)."""
    return None if norm is None or max_norm is None else expected_clip_coef(norm, max_norm)


def _per_member(shown: str, members: tuple[int, ...], once: float, norm_type: float) -> str:
    """How a group's full norm summed over the group again reads (stage norms all-reduced over the
    data-parallel group instead of the pipeline group give it): the group holds part of the step only."""
    count = len(members)
    return (
        f"the norm of {shown} ({once:.6g}; the group holds part of the parameters only), complete on each of "
        f"its {count} ranks and summed over the group again instead of across the other groups: "
        f"{count}^(1/{norm_type:g}) x {once:.6g}"
    )


def _match_of(observed: float, what: str, close: list[Candidate]) -> Match:
    """The match of the observed number with the candidates close to it (in order of plausibility)."""
    if not close:
        return Match(observed=observed, what=what, candidate=None)
    best = close[0]
    if len(close) == 1:
        return Match(observed=observed, what=what, candidate=best)
    coinciding = tuple(dict.fromkeys(c.hypothesis for c in close[1:] if c.hypothesis != best.hypothesis))
    return Match(observed=observed, what=what, candidate=best, coinciding=coinciding)


def _close(observed: float, candidates: tuple[Candidate, ...], rtol: float) -> list[Candidate]:
    """The candidates with relative_difference(observed, value) <= rtol, in order: for a finite
    number, the same arithmetic inline (every candidate of every rank of a many-rank step is tried)."""
    if not math.isfinite(observed):
        return [c for c in candidates if relative_difference(observed, c.value) <= rtol]
    size = abs(observed)
    return [
        c
        for c in candidates
        if (value := c.value) == observed
        or (
            value == value  # a nan value is never close to a finite number
            and abs(observed - value) / (size if size >= abs(value) else abs(value)) <= rtol
        )
    ]


def _implied_norm(coef: float | None, max_norm: float | None, rtol: float) -> float | None:
    """The norm a coefficient below 1 was computed from: max_norm / coef - 1e-6."""
    if coef is None or max_norm is None or not (0 < coef < 1 - rtol) or not math.isfinite(coef):
        return None
    return max_norm / coef - CLIP_EPS


def _decide(
    reported: Match | None, implied: Match | None, coef_is_one: bool, coef: float | None, rtol: float
) -> tuple[Hypothesis | None, bool, str]:
    """(hypothesis, logging_bug, detail) from the two matches; the applied coefficient shows what clipping used,
    unless the reported norm's accounting gives parameters different coefficients: the rank's coefficient
    is then a mean over them, no norm's (`coef`, within the range that accounting gives, says so)."""
    mean = _mean_of_several(reported, implied, coef, rtol)
    if mean is not None:
        return mean
    if implied is None:
        if reported is None:
            return None, False, "no reported norm and no applied coefficient below 1 to match"
        detail = _describe(reported)
        if coef_is_one and reported.hypothesis != CORRECT:
            detail += "; its applied coefficient 1 (no scaling) is what clipping by this norm gives"
        return reported.hypothesis, False, detail
    if reported is None:
        return implied.hypothesis, False, _describe(implied)
    if reported.hypothesis == implied.hypothesis:
        return reported.hypothesis, False, _describe(reported)
    if implied.hypothesis == CORRECT:
        return (
            reported.hypothesis,
            True,
            _describe(reported) + "; but the applied coefficient matches the true norm",
        )
    return implied.hypothesis, False, _describe(implied) + f"; the reported norm says {reported.hypothesis}"


def _mean_of_several(
    reported: Match | None, implied: Match | None, coef: float | None, rtol: float
) -> tuple[Hypothesis, bool, str] | None:
    """The reported norm's accounting, when it gives parameters different coefficients (a parameter
    listed twice: c and c²; one clip call per param group) and the rank's coefficient lies between
    them, while the norm it implies matches something else or nothing: that norm is a mean's, not one."""
    candidate = None if reported is None else reported.candidate
    if reported is None or candidate is None or candidate.coef_range is None or coef is None:
        return None
    if implied is not None and implied.hypothesis in (
        reported.hypothesis,
        CORRECT.scaled(implied.hypothesis.loss_scaled),
    ):
        return None  # the coefficient is one norm's after all (a wrong logged number: GA205)
    low, high = candidate.coef_range
    if not low * (1 - rtol) <= coef <= high * (1 + rtol):
        return None
    return (
        reported.hypothesis,
        False,
        f"{_describe(reported)}; its applied coefficient {coef:.6g} is a mean over parameters that received "
        f"between {low:.6g} and {high:.6g}, not the coefficient of one norm",
    )


def _describe(match: Match) -> str:
    if match.candidate is None:
        return f"{match.what} {match.observed:.6g} matches no known accounting"
    text = f"{match.what} {match.observed:.6g} matches {match.candidate.description} ({match.candidate.value:.6g})"
    # Where every rank holds every gradient (DDP) a local norm is the global one: the two coincide
    # without changing the conclusion, so only a coincidence that would is said.
    coinciding = [h for h in match.coinciding if not _same_conclusion(match.candidate.hypothesis, h)]
    if coinciding:
        text += f"; indistinguishable here from {', '.join(h.text for h in coinciding)}"
    return text


def _same_conclusion(chosen: Hypothesis, coinciding: Hypothesis) -> bool:
    """A local-only norm that equals the true one (each rank holds everything) is right on this layout."""
    scaled = chosen.loss_scaled
    return chosen == CORRECT.scaled(scaled) and coinciding == LOCAL_ONLY.scaled(scaled)


def diagnose(step: StepFacts, terms: NormInput) -> StepDiagnosis:
    """The true global norm, the expected coefficient, and every present rank's diagnosis: the
    numbers from `terms` (a loaded dump's or the guard's), the clip records and topology from `step`."""
    norm_type = terms.norm_type
    max_norm = None if step.clip is None else step.clip.max_norm
    norms = NormSet(terms.grad, norm_type)
    shared = _StepWide(step, norms)
    groups = (members for lists in step.topology.groups.values() for members in lists)
    norms.prime(itertools.chain([shared.all_ranks], ((r,) for r in shared.all_ranks), groups))
    true_norm, note, lower_bound = _true_norm(step, terms, norms.norm(shared.all_ranks, True)[0])
    post_clip = None
    bounded_or_known = true_norm is not None or lower_bound is not None
    if terms.clipped is not None and terms.grad.rank.size and bounded_or_known:
        post_clip = NormSet(terms.clipped, norm_type).norm(shared.all_ranks, True)[0]
    expected = expected_coef_of(true_norm, max_norm)
    rtol = max(norm_rtol(set(terms.dtypes)), MIN_RTOL)
    loss_scale = loss_scale_of(step)
    shared.know(true_norm, loss_scale)
    num_calls_max, call_norms, mixed, moment = _moment(step, terms, rtol)
    shares = shares_of_squared_norm(terms, shared.all_ranks, norms)
    first_call = call_norms[0].norm if call_norms else None
    further = _FurtherCandidates(step, terms, norms, shared, rtol, first_call)
    memo = _Memo(shared)
    ranks = {}
    for rank in step.ranks_present:
        rank_true = true_norm
        if true_norm is not None and rank in terms.drifted:
            rank_true = norms.norm(shared.all_ranks, True, first=rank)[0]
        local = norms.norm((rank,), False)[0]
        candidates = _candidates(rank, local, true_norm, rank_true, shared)
        rank_clip = step.ranks[rank].clip
        num_calls = len(rank_clip.calls) if rank_clip is not None else 0
        reported = reported_norm_of(step, rank)
        if num_calls > 1 and rank_clip is not None and rank_clip.calls[-1].reported_norm is not None:
            reported = rank_clip.calls[-1].reported_norm
        unmatched = mixed and num_calls > 1  # the dumped gradients are of another moment
        coef, source = (None, None) if unmatched else _applied_coef(step, rank, terms, max_norm)
        implied = _implied_norm(coef, max_norm, rtol) if source != "reported_norm" else None
        if unmatched:
            reported_match = implied_match = None
            hypothesis, logging_bug = None, False
            detail = (
                f"clipping ran {num_calls} times before this optimizer step (GA501) and the dump holds the "
                "gradient from before the first call only: its norms are not matched"
            )
        else:
            bounded = None
            if true_norm is None and lower_bound is not None:
                bounded = _BoundedMatcher(step, rank, norms, lower_bound, rtol)
            more = functools.partial(further.for_rank, rank, true_norm)
            candidates, reported_match, implied_match = _match_both(
                reported, implied, candidates, rtol, bounded, more, memo
            )
            coef_is_one = (
                coef is not None and source != "reported_norm" and relative_difference(coef, 1.0) <= rtol
            )
            hypothesis, logging_bug, detail = memo.decide(
                reported_match, implied_match, coef_is_one, coef if source == "gradients" else None, rtol
            )
            if bounded is not None:
                detail = bounded.detail(hypothesis, detail)
            if num_calls > 1:
                detail = f"at the last of {num_calls} clip calls: {detail}"
        ranks[rank] = RankDiagnosis(
            rank=rank,
            local_norm=local,
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
            share_of_squared_norm=shares.get(rank, 0.0),
            rtol=rtol,
            true_norm=rank_true,
            expected_coef=expected if rank_true is true_norm else expected_coef_of(rank_true, max_norm),
            num_clip_calls=num_calls,
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
        num_clip_calls=num_calls_max,
        moment=moment,
        mixed_moments=mixed,
        call_norms=call_norms,
        norm_lower_bound=lower_bound,
    )


class _FurtherCandidates:
    """The hypotheses of hypotheses.py, built only for a rank whose number the usual ones leave unexplained."""

    def __init__(
        self,
        step: StepFacts,
        terms: NormInput,
        norms: NormSet,
        shared: _StepWide,
        rtol: float,
        first_call_norm: float | None,
    ) -> None:
        self.step, self.terms, self.norms, self.shared = step, terms, norms, shared
        self.rtol, self.first_call_norm = rtol, first_call_norm
        self.max_norm = None if step.clip is None else step.clip.max_norm
        self._averaged: dict[tuple[str, tuple[int, ...]], list[Candidate]] = {}

    @functools.cached_property
    def _param_groups(self) -> tuple[tuple[ParamGroup, ...], dict[str, NormSet]]:
        import numpy as np

        terms = self.terms
        groups = groups_of(param_signatures(terms))
        ids = {name: i for i, name in enumerate(terms.param_names)}
        per_group: dict[str, NormSet] = {}
        for group in groups:
            inside = np.zeros(len(terms.param_names), dtype=bool)
            inside[[ids[name] for name in group.params]] = True
            per_group[group.label] = NormSet(terms.grad.subset(inside[terms.param]), terms.norm_type)
        return groups, per_group

    @functools.cached_property
    def _params(self) -> ParamTerms:
        return _param_terms(self.step, self.terms, self.norms, self.shared.all_ranks)

    def for_rank(
        self, rank: int, true_norm: float | None, observed: tuple[float | None, ...]
    ) -> tuple[Candidate, ...]:
        """The further candidates for this rank's observed numbers (the reported norm, the implied one)."""
        groups, per_group = self._param_groups
        step, norms, norm_type = self.step, self.norms, self.terms.norm_type
        extras = []
        if groups and true_norm is not None:
            norm_of = {label: _norm_fn(n) for label, n in per_group.items()}
            extras += group_candidates(step, rank, groups, norm_of, norm_type)
        clip = step.ranks[rank].clip
        if clip is not None and len(clip.calls) > 1:
            extras += per_param_group_candidates(
                [call.reported_norm for call in clip.calls], self.first_call_norm, norm_type, self.max_norm
            )
        extras += averaged_candidates(step, rank, lambda r: norms.norm((r,), False)[0], self._averaged)
        extras += every_copy_candidates(step, rank, _norm_fn(norms), norm_type, self.shared.holds_everything)
        # after the whole-step accountings: one parameter counted twice is the narrower explanation
        extras += listed_twice_candidates(
            observed, true_norm, norm_type, self.max_norm, self._params, self.rtol
        )
        extras += overflow_candidates(true_norm, norm_type, sorted(self.terms.dtypes))
        return tuple(extras)


def _param_terms(step: StepFacts, terms: NormInput, norms: NormSet, ranks: tuple[int, ...]) -> ParamTerms:
    """Each parameter's term of the true norm (its elements once) and of its clipped gradient, for the
    listed-twice hypothesis; none when the entries are the guard's ownership groups, not parameters,
    and parameters with an unknown or nonfinite term left out."""
    import numpy as np

    if any(step.ranks[r].capture_api == GROUP_PIECES_API for r in step.ranks_present):
        return ParamTerms(names=(), terms=np.zeros(0), clipped=None, total_term=0.0, total_clipped=math.nan)
    rows, _ = norms.rows(tuple(sorted(ranks)), True)
    grad, size = terms.grad, len(terms.param_names)
    param = terms.param[rows]
    bad = np.bincount(param, weights=(grad.flags[rows] & (UNKNOWN | NAN | INF)) != 0, minlength=size) > 0
    per_param = np.bincount(param, weights=grad.term[rows], minlength=size)
    clipped = None
    if terms.clipped is not None:
        unknown = (terms.clipped.flags[rows] & (UNKNOWN | NAN | INF)) != 0
        clipped = np.bincount(param, weights=np.where(unknown, 0.0, terms.clipped.term[rows]), minlength=size)
        clipped[np.bincount(param, weights=unknown, minlength=size) > 0] = np.nan
    held = np.bincount(param, minlength=size) > 0
    keep = np.flatnonzero(held & ~bad & (per_param > 0))
    order = keep[np.argsort(per_param[keep], kind="stable")]
    return ParamTerms(
        names=tuple(terms.param_names[i] for i in order.tolist()),
        terms=per_param[order],
        clipped=None if clipped is None else clipped[order],
        total_term=float(per_param[~bad].sum()) if not bad.any() else math.nan,
        total_clipped=math.nan if clipped is None else float(clipped[held].sum()),
    )


def _norm_fn(norms: NormSet) -> NormOf:
    return lambda ranks, dedupe: norms.norm(ranks, dedupe)[0]


def _true_norm(
    step: StepFacts, terms: NormInput, value: float | None
) -> tuple[float | None, str, float | None]:
    """(true norm or None, why it is unknown, the lower bound the present ranks give when ranks are
    missing), from `value`, the norm of the present ranks' entries, each layout once."""
    if value is None:
        return None, f"the dumped statistics were taken for another norm type than {terms.norm_type:g}", None
    if step.missing_ranks and not terms.covers_every_param:
        bound = value if math.isfinite(value) else None
        return None, f"{missing_text(step.missing_ranks)} and held parts of the gradient", bound
    return value, "", None


def _moment(step: StepFacts, terms: NormInput, rtol: float) -> tuple[int, tuple[CallNorm, ...], bool, str]:
    """(most clip calls on a rank, true norm before each call, whether the dumped pre- and post-clip
    gradients are of different moments, when the dumped pre-clip gradient was taken)."""
    num_calls = max(
        (len(clip.calls) for clip in (step.ranks[r].clip for r in step.ranks_present) if clip is not None),
        default=0,
    )
    if num_calls <= 1:
        return num_calls, (), False, ""
    call_norms = tuple(
        _call_norm(call + 1, entries, terms.norm_type, rtol) for call, entries in enumerate(terms.calls)
    )
    mixed = not call_norms
    moment = f"before the {'first' if mixed else 'last'} of {num_calls} clip calls"
    return num_calls, call_norms, mixed, moment


def _match_both(
    reported: float | None,
    implied: float | None,
    candidates: tuple[Candidate, ...],
    rtol: float,
    bounded: _BoundedMatcher | None,
    more: Callable[[tuple[float | None, ...]], tuple[Candidate, ...]],
    memo: _Memo,
) -> tuple[tuple[Candidate, ...], Match | None, Match | None]:
    """(candidates tried, match of the reported norm, match of the implied norm): the usual candidates
    first, then, when one number is left unexplained (and the true norm is known), the further ones."""

    def both(tried: tuple[Candidate, ...]) -> tuple[Match | None, Match | None]:
        def one(observed: float | None, what: str) -> Match | None:
            if observed is None:
                return None
            if bounded is not None:
                return bounded.match(observed, what, tried)
            return memo.match(observed, what, tried, rtol)

        return one(reported, "reported norm"), one(implied, "norm implied by the applied coefficient")

    reported_match, implied_match = both(candidates)
    if bounded is None and any(
        x is not None and x.candidate is None for x in (reported_match, implied_match)
    ):
        candidates = candidates + more((reported, implied))
        reported_match, implied_match = both(candidates)
    return candidates, reported_match, implied_match


def missing_text(ranks: Iterable[int]) -> str:
    """ "rank 2 is missing" or "ranks 2-3 are missing"."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]} is missing"
    return f"ranks {compact_ranks(ranks)} are missing"


class _BoundedMatcher:
    """Matching a rank's number when ranks are missing: only a lower bound on the true norm is known.

    A number below the bound is certainly not the true norm (nor any norm that counts more than the
    present ranks hold); it is named as a mistake only when that mistake is computable from the
    present ranks and no other accounting, partly held by the missing ranks, could also give it.
    """

    def __init__(self, step: StepFacts, rank: int, norms: NormSet, lower_bound: float, rtol: float) -> None:
        self.lower_bound, self.rtol = lower_bound, rtol
        self.undecided: list[str] = []
        self.partial_groups: list[tuple[str, float]] = []
        """Groups of this rank with missing members: (name, norm of their present members)."""
        for name in sorted(step.topology.groups):
            members = step.topology.group_of(name, rank)
            if not members or not any(r in step.missing_ranks for r in members):
                continue
            present = tuple(sorted(r for r in members if r not in step.missing_ranks))
            value = norms.norm(present, True)[0]
            if value is not None:
                self.partial_groups.append((name, value))

    def detail(self, hypothesis: Hypothesis | None, detail: str) -> str:
        """The rank's detail, saying what the bound decided or why it could not."""
        if hypothesis is None:
            return "; ".join(self.undecided) if self.undecided else detail
        return (
            f"{detail}; below {self.lower_bound:.6g}, the lower bound on the true norm from the present ranks, "
            "so it is not the true norm"
        )

    def match(self, observed: float, what: str, candidates: tuple[Candidate, ...]) -> Match | None:
        bound = self.lower_bound
        if not observed < bound * (1 - self.rtol):
            self.undecided.append(
                f"{what} {observed:.6g} is not below {bound:.6g}, the norm of what the present ranks hold "
                "(a lower bound on the true norm): with ranks missing, it may be the true norm"
            )
            return None
        found = _match_of(observed, what, _close(observed, candidates, self.rtol))
        if found.candidate is None:
            return found
        rivals = [name for name, value in self.partial_groups if value <= observed * (1 + self.rtol)]
        if rivals:
            self.undecided.append(
                f"{what} {observed:.6g} is below the lower bound {bound:.6g} and matches "
                f"{found.candidate.description}, but could also be a norm over group "
                f"{', '.join(rivals)}, whose missing ranks are not in the dump"
            )
            return None
        return found


def _call_norm(call: int, entries: Entries, norm_type: float, rtol: float) -> CallNorm:
    """The true global norm before clip call `call`: replicas count once through their lowest-rank
    copy (copies that differ at the call are noted)."""
    import numpy as np

    norm, repeated = NormSet(entries, norm_type).norm(sorted(set(entries.rank.tolist())), True)
    differ = False
    if repeated:
        _, first, inverse = np.unique(entries.layout, return_index=True, return_inverse=True)
        base = entries.term[first][inverse]  # each entry's first copy (itself, for a first copy)
        differ = any(
            relative_difference(a, b) > rtol
            for a, b in zip(base.tolist(), entries.term.tolist(), strict=True)
        )
    return CallNorm(call=call, norm=norm, replicas_differ=differ)
