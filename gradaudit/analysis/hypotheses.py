"""Further norms a training code may have used, tried when the usual ones do not explain a rank's number:
one group of parameters accounted wrongly (dropped, every replica counted, reduced over another process
group), per-rank norms averaged instead of squares summed, a group's full norm counted once per member,
a wrong clip list (one parameter listed twice, one clip call per param group), and a norm that overflowed
in its working precision (pure: works on measurements only)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import StepFacts
from ..norms import expected_clip_coef, is_inf_norm, norm_of_terms, power, relative_difference, safe_fsum
from ..ranksets import compact_ranks

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True, kw_only=True)
class Hypothesis:
    """An accounting (right or mistaken) a rank's norm may come from; `text` is how the reports and
    the evidence write it ("local_only", "wrong_group:tp", "loss_scaled:param_group:experts:dropped")."""

    kind: str
    """One of the kinds below: correct, local_only, replicas_double_counted, wrong_group, param_group,
    averaged, every_copy, listed_twice, per_param_group, overflow, unexplained."""
    what: str = ""
    """What the kind is about: the process group (wrong_group, averaged, every_copy), the dtype
    (overflow), the parameter (listed_twice), or "<label>:<how>" of a parameter group, <how> one of
    dropped, every_copy, local, over:<group>; "" for the others."""
    loss_scaled: bool = False
    """The accounting's norm of gradients still multiplied by the loss scale."""

    @property
    def text(self) -> str:
        text = f"{self.kind}:{self.what}" if self.what else self.kind
        return f"loss_scaled:{text}" if self.loss_scaled else text

    def __str__(self) -> str:
        return self.text

    def scaled(self, loss_scaled: bool = True) -> Hypothesis:
        """This accounting, of loss-scaled gradients or (False) not."""
        if loss_scaled == self.loss_scaled:
            return self  # asked once per rank and check: no copy of an equal value
        return Hypothesis(kind=self.kind, what=self.what, loss_scaled=loss_scaled)


CORRECT = Hypothesis(kind="correct")
LOCAL_ONLY = Hypothesis(kind="local_only")
DOUBLE_COUNTED = Hypothesis(kind="replicas_double_counted")
UNEXPLAINED = Hypothesis(kind="unexplained")
WRONG_GROUP = "wrong_group"
"""Kind: the norm reduced over process group `what` only: its members' own pieces, or, when the group
holds part of the step, the group's full norm once per member (each member held it complete, as a
DTensor's norm is, and the squares were all-reduced over the same group again)."""
PARAM_GROUP = "param_group"
"""Kind: one parameter group (`what`: "<label>:<how>") accounted wrongly, the rest right."""
AVERAGED = "averaged"
"""Kind: the mean of the local norms of group `what` (or of their squares)."""
EVERY_COPY = "every_copy"
"""Kind: group `what` (holding every element of the step) has its norm computed in full on each of its
ranks and their p-th powers summed over the group again: |group|^(1/p) times the true norm."""
LISTED_TWICE = "listed_twice"
"""Kind: the true norm with parameter `what` counted twice (listed twice in the clip list, as a tied
weight under both of its names): norm^p = true^p + |what|^p."""
PER_PARAM_GROUP = "per_param_group"
"""Kind: each of several clip calls took the norm of its own parameters only (one call per optimizer
param group): the p-th powers of the calls' norms add up to the true norm's before the first call."""
OVERFLOW = "overflow"
"""Kind: the true norm, which overflows in dtype `what`."""

DTYPE_MAX = {"float32": 3.4028234663852886e38, "float16": 65504.0, "bfloat16": 3.3895313892515355e38}
"""Largest finite value of the dtypes a norm is commonly accumulated in."""

NormOf = Callable[[tuple[int, ...], bool], float | None]
"""norm(ranks, dedupe) of some pieces over a set of ranks (replicas once when dedupe)."""


@dataclass(frozen=True, kw_only=True)
class ParamGroup:
    """Parameters the step holds alike: on the same number of ranks, with the same number of copies."""

    label: str
    params: frozenset[str]
    num_holders: int

    @property
    def description(self) -> str:
        n = len(self.params)
        return (
            f"the {self.label!r} parameters ({n} parameter{'s' if n != 1 else ''}, each held by "
            f"{self.num_holders} rank{'s' if self.num_holders != 1 else ''})"
        )


def groups_of(signatures: Mapping[str, tuple[int, int]]) -> tuple[ParamGroup, ...]:
    """The step's parameters grouped by how they are held, from each parameter's (number of ranks
    holding it, most copies of one layout); none when they are all alike."""
    by_signature: dict[tuple[int, int], set[str]] = {}
    for param, signature in signatures.items():
        by_signature.setdefault(signature, set()).add(param)
    if len(by_signature) < 2:
        return ()
    return tuple(
        ParamGroup(
            label=_label(params, [p for sig, ps in by_signature.items() if sig != signature for p in ps]),
            params=frozenset(params),
            num_holders=signature[0],
        )
        for signature, params in sorted(by_signature.items())
    )


def _tokens(name: str) -> list[str]:
    return [t for t in name.split(".") if not t.isdigit()]


def _label(params: set[str], others: Sequence[str]) -> str:
    """A name part all of the group's parameters share and no other parameter has (the last such,
    e.g. "local_experts"), else the first parameter's name."""
    names = sorted(params)
    common = [t for t in _tokens(names[0]) if all(t in _tokens(n) for n in names[1:])]
    other_tokens = [set(_tokens(n)) for n in others]
    exclusive = [t for t in common if all(t not in o for o in other_tokens)]
    return exclusive[-1] if exclusive else names[0]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """A norm some accounting (correct or mistaken) produces from this step's numbers."""

    hypothesis: Hypothesis
    value: float
    description: str
    """What it counts, in words, for the report."""
    coef_range: tuple[float, float] | None = None
    """(lowest, highest) coefficient this accounting gives some parameters, when it gives them different
    ones: a rank's measured coefficient is then a mean over them that lies between the two, no
    coefficient of any norm (GA304 names the parameters); None when every parameter gets one."""


def group_candidates(
    step: StepFacts,
    rank: int,
    groups: Sequence[ParamGroup],
    norm_of_group: Mapping[str, NormOf],
    norm_type: float,
) -> list[Candidate]:
    """Every accounting where one parameter group departs from the correct one and the rest is right."""
    present = tuple(step.ranks_present)
    maybe = {g.label: _term(norm_of_group[g.label](present, True), norm_type) for g in groups}
    correct = {label: v for label, v in maybe.items() if v is not None}
    if len(correct) < len(maybe):
        return []
    found: list[Candidate] = []
    for group in groups:
        norm = norm_of_group[group.label]
        options: list[tuple[str, str, float | None]] = [
            ("dropped", "left out of the norm", 0.0),
            ("every_copy", "counted on every rank (every replica)", _term(norm(present, False), norm_type)),
            ("local", f"taken from rank {rank}'s own pieces only", _term(norm((rank,), False), norm_type)),
        ]
        for name, members in _complete_groups(step, rank):
            over = f"process group {name!r}"
            options.append(
                (f"over:{name}", f"reduced over {over} only", _term(norm(members, True), norm_type))
            )
            every = _term(norm(members, False), norm_type)
            options.append((f"over:{name}", f"summed over {over} with every replica counted", every))
        seen: list[float] = []
        for how, text, term in options:
            if term is None or relative_difference(term, correct[group.label]) == 0:
                continue
            rest = [v for label, v in correct.items() if label != group.label]
            value = norm_of_terms([*rest, term], norm_type)
            if any(relative_difference(value, s) == 0 for s in seen):
                continue
            seen.append(value)
            found.append(
                Candidate(
                    hypothesis=Hypothesis(kind=PARAM_GROUP, what=f"{group.label}:{how}"),
                    value=value,
                    description=f"{group.description} {text}, every other parameter counted once",
                )
            )
    return found


def averaged_candidates(
    step: StepFacts,
    rank: int,
    local_norm: Callable[[int], float | None],
    memo: dict[tuple[str, tuple[int, ...]], list[Candidate]],
) -> list[Candidate]:
    """Each named group's (and the world's) mean of per-rank local norms, and root mean square
    (`memo` keeps them per group, shared by its members: a world of thousands of ranks is one group)."""
    found: list[Candidate] = []
    for key in _complete_groups(step, rank, 2):
        if key not in memo:
            memo[key] = _averaged(*key, local_norm)
        found += memo[key]
    return found


def _averaged(
    name: str, members: tuple[int, ...], local_norm: Callable[[int], float | None]
) -> list[Candidate]:
    norms = [local_norm(m) for m in members]
    values = [float(n) for n in norms if n is not None and math.isfinite(n)]
    if len(values) < len(norms):
        return []
    shown = f"ranks {compact_ranks(members)} (group {name})"
    return [
        Candidate(
            hypothesis=Hypothesis(kind=AVERAGED, what=name),
            value=safe_fsum(values) / len(values),
            description=f"the mean of the local norms of {shown}, instead of the root of their summed squares",
        ),
        Candidate(
            hypothesis=Hypothesis(kind=AVERAGED, what=name),
            value=math.sqrt(safe_fsum(v * v for v in values) / len(values)),
            description=f"the root of the mean of the squared local norms of {shown}, instead of their sum",
        ),
    ]


def every_copy_candidates(
    step: StepFacts,
    rank: int,
    norm_of: NormOf,
    norm_type: float,
    holds_everything: Callable[[tuple[int, ...]], bool],
) -> list[Candidate]:
    """For each named group of this rank (the world included) that holds every element of the step:
    the group's norm (replicas once, the true norm) counted once per member, as when every rank
    computes the full norm (a DTensor's `full_tensor()`, ZeRO-3's `safe_get_full_grad`) and the squares
    are all-reduced over the group again.

    A group that holds only part of the step (a pipeline stage's data-parallel group) is left to the
    wrong-group hypotheses (diagnosis._candidates): its full norm summed over it again is a norm
    reduced over that group and never across the others (stage norms all-reduced over the
    data-parallel group instead of the pipeline group), whatever the count of copies."""
    if is_inf_norm(norm_type):
        return []  # a max counted many times is the same max
    found: list[Candidate] = []
    seen: set[tuple[int, ...]] = set()
    for name, members in _complete_groups(step, rank, 2):
        if members in seen:
            continue
        seen.add(members)
        if not holds_everything(members):
            continue
        norm = norm_of(members, True)
        if norm is None or not math.isfinite(norm):
            continue
        count = len(members)
        found.append(
            Candidate(
                hypothesis=Hypothesis(kind=EVERY_COPY, what=name),
                value=norm * count ** (1.0 / norm_type),
                description=(
                    f"the norm of ranks {compact_ranks(members)} (group {name}) computed in full on each of its "
                    f"{count} ranks and summed over the group again: {count}^(1/{norm_type:g}) x {norm:.6g}"
                ),
            )
        )
    return found


MAX_LISTED_TWICE = 3
"""The most parameters one number is tried as "listed twice" against (those nearest it)."""


@dataclass(frozen=True, kw_only=True, eq=False)
class ParamTerms:
    """Each parameter's term of the true norm, ascending, with its clipped gradient's: what the
    listed-twice hypothesis searches (a sorted array, so that a step of many parameters is searched
    in log time per number)."""

    names: tuple[str, ...]
    """The parameters with a nonzero, finite term, in the order of `terms`."""
    terms: np.ndarray
    """float64, ascending: sum |g|^p of each parameter's gradient, each element once."""
    clipped: np.ndarray | None
    """float64, as `terms`: sum |g|^p of each parameter's clipped gradient (nan where unknown); None when
    no clipped gradient was dumped."""
    total_term: float
    """The sum of every parameter's term (the true norm's p-th power; nan when some term is unknown)."""
    total_clipped: float
    """The sum of every parameter's clipped term (nan when some is unknown or none was dumped)."""

    def coefs(self, index: int, norm_type: float) -> tuple[float, float] | None:
        """(the coefficient parameter `index` received, the one every other parameter received together),
        from the clipped and unclipped terms; None when they were not both measured."""
        if self.clipped is None:
            return None
        own, own_clipped = float(self.terms[index]), float(self.clipped[index])
        rest, rest_clipped = self.total_term - own, self.total_clipped - own_clipped
        if not all(math.isfinite(v) and v >= 0 for v in (own_clipped, rest, rest_clipped)) or rest <= 0:
            return None
        return power(own_clipped / own, 1 / norm_type), power(rest_clipped / rest, 1 / norm_type)


def listed_twice_candidates(
    observed: Sequence[float | None],
    true_norm: float | None,
    norm_type: float,
    max_norm: float | None,
    params: ParamTerms,
    rtol: float,
) -> list[Candidate]:
    """For each observed number above the true norm: the true norm with one parameter counted twice,
    norm^p = true^p + |param|^p, as when a parameter is listed twice in the clip list (a tied weight
    under both of its names: `list(model.parameters()) + [model.lm_head.weight]`). The parameters whose
    term gives the number within `rtol` (the nearest when none does), less those whose measured
    coefficients contradict it: listed twice, a parameter is scaled twice, c² against the others' c."""
    if true_norm is None or not math.isfinite(true_norm) or is_inf_norm(norm_type) or not params.names:
        return []
    total = power(true_norm, norm_type)
    found: list[Candidate] = []
    seen: set[str] = set()
    for value in observed:
        if value is None or not math.isfinite(value) or value <= true_norm * (1 + rtol):
            continue
        extra = power(value, norm_type) - total
        low, high = (power(value * f, norm_type) - total for f in (1 - rtol, 1 + rtol))
        start, stop = (int(i) for i in params.terms.searchsorted([low, high]))
        near = (
            range(start, stop)
            if stop > start
            else range(max(start - 1, 0), min(start + 1, len(params.names)))
        )
        chosen = sorted(near, key=lambda i: (abs(float(params.terms[i]) - extra), params.names[i]))
        for index in chosen[: MAX_LISTED_TWICE if stop > start else 1]:
            name, own = params.names[index], float(params.terms[index])
            coefs = params.coefs(index, norm_type)
            if (
                name in seen
                or relative_difference(own, total) <= rtol  # the whole gradient twice: every copy's
                or (coefs is not None and relative_difference(coefs[0], coefs[1] ** 2) > 4 * rtol)
            ):
                continue
            seen.add(name)
            candidate_value = norm_of_terms([total, own], norm_type)
            coef = None if max_norm is None else expected_clip_coef(candidate_value, max_norm)
            found.append(
                Candidate(
                    hypothesis=Hypothesis(kind=LISTED_TWICE, what=name),
                    value=candidate_value,
                    description=(
                        f"the true norm {true_norm:.6g} with parameter {name} (norm {power(own, 1 / norm_type):.6g}) "
                        "counted twice, as a parameter listed twice in the clip list is"
                    ),
                    coef_range=None if coef is None or coef >= 1 else (coef * coef, coef),
                )
            )
    return found


def per_param_group_candidates(
    call_norms: Sequence[float | None],
    first_call_true_norm: float | None,
    norm_type: float,
    max_norm: float | None,
) -> list[Candidate]:
    """With several clip calls, each taking the norm of its own parameters only (one call per optimizer
    param group: `for g in opt.param_groups: clip_grad_norm_(g["params"], max_norm)`): the groups split
    the parameters, so the last call's norm is what the true norm before the first call leaves once the
    other calls' norms are taken out, norm_K^p = true^p - sum of norm_k^p over the other calls."""
    earlier = call_norms[:-1]
    if (
        len(call_norms) < 2
        or first_call_true_norm is None
        or not math.isfinite(first_call_true_norm)
        or is_inf_norm(norm_type)
        or any(n is None or not math.isfinite(n) or n <= 0 for n in earlier)
    ):
        return []
    others = [float(n) for n in earlier if n is not None]
    left = power(first_call_true_norm, norm_type) - safe_fsum(power(n, norm_type) for n in others)
    if left <= 0:
        return []
    value = power(left, 1 / norm_type)
    coef = None if max_norm is None else expected_clip_coef(value, max_norm)
    num = len(call_norms)
    shown = ", ".join(f"{n:.6g}" for n in others)
    return [
        Candidate(
            hypothesis=Hypothesis(kind=PER_PARAM_GROUP),
            value=value,
            description=(
                f"the true norm {first_call_true_norm:.6g} before the first of {num} clip calls less the norm"
                f"{'s' if len(others) > 1 else ''} the other call{'s' if len(others) > 1 else ''} reported "
                f"({shown}): each call took the norm of its own parameters only, as clipping once per "
                "param group does"
            ),
            coef_range=None if coef is None or coef >= 1 else (coef, 1.0),
        )
    ]


def overflow_candidates(true_norm: float | None, norm_type: float, dtypes: Sequence[str]) -> list[Candidate]:
    """The true norm computed in a dtype where the sum of |g|^p (or g itself) is beyond the largest value."""
    if true_norm is None or not math.isfinite(true_norm) or is_inf_norm(norm_type):
        return []
    total = power(true_norm, norm_type)
    tried = [d for d in ("float16", "bfloat16") if d in dtypes] + ["float32"]  # float32: always tried
    dtype = next((d for d in tried if total > DTYPE_MAX[d]), None)
    if dtype is None:
        return []
    return [
        Candidate(
            hypothesis=Hypothesis(kind=OVERFLOW, what=dtype),
            value=math.inf,
            description=f"the true norm {true_norm:.6g} computed in {dtype}, whose sum of |g|^{norm_type:g} "
            f"({total:.6g}) overflows to inf",
        )
    ]


def _complete_groups(step: StepFacts, rank: int, smallest: int = 1) -> list[tuple[str, tuple[int, ...]]]:
    """(name, members as the topology lists them) of each named group of this rank with at least
    `smallest` members, none of them missing (not sorted: a world of thousands of ranks is one tuple,
    shared by its members, and the norms sort their rank sets themselves)."""
    found = []
    for name in sorted(step.topology.groups):
        members = step.topology.group_of(name, rank)
        if members and len(members) >= smallest and not any(m in step.missing_ranks for m in members):
            found.append((name, tuple(members)))
    return found


def _term(norm: float | None, norm_type: float) -> float | None:
    if norm is None:
        return None
    if is_inf_norm(norm_type) or not math.isfinite(norm):
        return norm
    return power(norm, norm_type)
