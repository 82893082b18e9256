"""The clip coefficient each parameter received, from its pre- and post-clip gradients: parameters
grouped by the coefficient they share, and what a step whose parameters received several shows (a
parameter scaled twice, one clip call per parameter group) (pure: works on measurements only)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import StepFacts
from ..norms import relative_difference, safe_fsum
from ..steptable import StepTable
from .diagnosis import StepDiagnosis, expected_coef_of

if TYPE_CHECKING:
    import numpy as np

LISTED_TWICE = "listed_twice"
"""Cause: some parameters received a power of the others' coefficient (scaled once per listing)."""
LEFT_OUT = "left_out"
"""Cause: some parameters were not scaled at all (coefficient 1) while the others were."""
PER_CALL = "per_call"
"""Cause: several clip calls, each scaling its own parameters by its own norm (once per param group)."""


@dataclass(frozen=True, kw_only=True)
class CoefGroup:
    """Parameters that received one coefficient (within the step's tolerance)."""

    coef: float
    params: tuple[str, ...]
    ranks: tuple[int, ...]
    """The ranks holding a measured piece of these parameters."""
    calls: tuple[int, ...] = ()
    """With several clip calls: the (1-based) calls that scaled them; () when none changed them."""
    power: int = 1
    """They received the first group's coefficient to this power (2: scaled twice, 0: never)."""


@dataclass(frozen=True, kw_only=True)
class ParamCoefficients:
    """The coefficients a step's parameters received, each the same on every rank holding it or not."""

    groups: tuple[CoefGroup, ...] = ()
    """Parameters sharing one coefficient: the group with the most parameters first."""
    mixed_ranks: tuple[int, ...] = ()
    """Ranks that applied more than one coefficient to their own parameters."""
    disagreeing: tuple[str, ...] = ()
    """Parameters whose holding ranks applied different coefficients to them."""
    expected_coef: float | None = None
    """What the true norm asks for: of the gradient before the first clip call when the coefficients
    span the calls (PER_CALL), else of the one the measured coefficients started from."""
    cause: str | None = None
    """LISTED_TWICE, LEFT_OUT, PER_CALL, or None when not recognised."""
    by_values: bool = False
    """Measured from the values (sum(pre * post) / sum(pre * pre)); else from sums of squares."""
    note: str = ""
    """Why no coefficient per parameter was measured (no groups then), or ""."""
    moment: str = ""
    """With several clip calls whose coefficients cannot be joined: "before the last of N clip calls",
    the last call's coefficients being the ones measured."""
    repeated_norm: float | None = None
    """With LISTED_TWICE (L2): the true norm with each repeated parameter counted as often as it was listed."""

    @property
    def differ(self) -> bool:
        """Some rank applied more than one coefficient to its own parameters."""
        return len(self.groups) > 1 and bool(self.mixed_ranks)


def clusters(values: Iterable[tuple[int, float]], rtol: float) -> list[list[tuple[int, float]]]:
    """Keyed values grouped: consecutive sorted values within `rtol` of their group's first."""
    groups: list[list[tuple[int, float]]] = []
    for key, value in sorted(values, key=lambda kv: (kv[1], kv[0])):
        if groups and relative_difference(groups[-1][0][1], value) <= rtol:
            groups[-1].append((key, value))
        else:
            groups.append([(key, value)])
    return groups


def _spread(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The relative difference of the largest and smallest positive value of each run of `values`
    beginning at `starts` (more than rtol: the run's values are not one coefficient)."""
    import numpy as np

    low, high = np.minimum.reduceat(values, starts), np.maximum.reduceat(values, starts)
    return (high - low) / np.where(high > 0, high, 1.0)


def _members_by_label(labels: np.ndarray, values: np.ndarray, num_labels: int) -> list[tuple[int, ...]]:
    """The distinct values (sorted) found with each label 0..num_labels-1."""
    import numpy as np

    found: list[tuple[int, ...]] = [() for _ in range(num_labels)]
    pairs, _ = _unique_pairs(labels, values)
    _, starts = np.unique(pairs[:, 0], return_index=True)
    for label, chunk in zip(pairs[starts, 0].tolist(), np.split(pairs[:, 1], starts[1:]), strict=True):
        found[label] = tuple(chunk.tolist())
    return found


def _unique_pairs(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique of the rows [first, second] (non-negative integers), with its inverse: as one key
    per row, which sorts as the rows do (np.unique over rows sorts a structured view, several times
    slower)."""
    import numpy as np

    width = int(second.max(initial=-1)) + 1
    keys, inverse = np.unique(first.astype(np.int64) * width + second, return_inverse=True)
    rows = np.stack([keys // width, keys % width], axis=1) if width else np.zeros((0, 2), dtype=np.int64)
    return rows, inverse.reshape(-1)


def param_coefficients(step: StepFacts, diagnosis: StepDiagnosis, table: StepTable) -> ParamCoefficients:
    """The step's per-parameter coefficients (none, with a note, when they cannot be measured; none
    without a note when fewer than two parameters have a nonzero finite gradient)."""
    num_calls = diagnosis.num_clip_calls
    if diagnosis.mixed_moments:
        return ParamCoefficients(
            note=f"the dump holds the gradient from before the first of {num_calls} clip calls and the "
            "clipped one from after the last, without per-call statistics"
        )
    if table.clipped is None:
        return ParamCoefficients(note="post-clip gradients (grad_clipped) were not dumped")
    import numpy as np

    rtol = diagnosis.rtol
    last_call, spanning, by_values = _per_rank_and_param(step, table, num_calls, rtol)
    per_call = spanning is not None
    rank, param, coef, call = last_call if spanning is None else spanning
    order = np.lexsort((rank, param))  # by parameter, then rank: each parameter's lowest rank first
    rank, param, coef, call = rank[order], param[order], coef[order], call[order]
    present, starts = np.unique(param, return_index=True)
    if present.size < 2:
        return ParamCoefficients()
    names = table.param_names
    disagreeing = tuple(sorted(names[p] for p in present[_spread(coef, starts) > rtol].tolist()))
    by_rank = np.argsort(rank, kind="stable")
    _, rank_starts = np.unique(rank[by_rank], return_index=True)
    mixed = tuple(np.unique(rank[by_rank][rank_starts[_spread(coef[by_rank], rank_starts) > rtol]]).tolist())
    grouped = clusters(zip(present.tolist(), coef[starts].tolist(), strict=True), rtol)
    # The most parameters first; of as many, a coefficient below 1 before 1, the larger before the
    # smaller: the others' coefficient a parameter left out (1) or scaled twice (c²) departs from.
    grouped.sort(key=lambda g: (-len(g), relative_difference(g[0][1], 1.0) <= rtol, -g[0][1]))
    label = np.zeros(len(names), dtype=np.int64)
    for i, members in enumerate(grouped):
        label[[p for p, _ in members]] = i
    ranks_of = _members_by_label(label[param], rank, len(grouped))
    calls_of = _members_by_label(label[param], call, len(grouped))
    groups = [
        CoefGroup(
            coef=members[0][1],
            params=tuple(sorted(names[p] for p, _ in members)),
            ranks=ranks_of[i],
            calls=tuple(c for c in calls_of[i] if c),
        )
        for i, members in enumerate(grouped)
    ]
    groups, cause = _cause(groups, per_call, rtol)
    return ParamCoefficients(
        groups=tuple(groups),
        mixed_ranks=mixed,
        disagreeing=disagreeing,
        expected_coef=_expected(diagnosis, per_call),
        cause=cause,
        by_values=by_values,
        repeated_norm=_repeated_norm(table, diagnosis, groups) if cause == LISTED_TWICE else None,
        moment="" if per_call else diagnosis.moment,
    )


Coefficients = tuple["np.ndarray", "np.ndarray", "np.ndarray", "np.ndarray"]
"""Per measured (rank, parameter): the rank, the parameter (its column id), the coefficient, and the
1-based clip call that changed it (0: none)."""


def _per_rank_and_param(
    step: StepFacts, table: StepTable, num_calls: int, rtol: float
) -> tuple[Coefficients, Coefficients | None, bool]:
    """(the last clip call's coefficients, the coefficients across every call, whether every one was
    measured from the values). With several calls, a coefficient spans them only when each parameter
    was changed by one call at most, and only by a scaling (None otherwise: the gradients changed
    between the calls, as a backward pass between them does, GA501). From the values' dot products
    (sum(pre * post) / sum(pre * pre)) when every piece with a post-clip gradient has them, else from
    the sums of squares; across the calls from the sums of squares before each, when comparable."""
    import numpy as np

    clipped = table.clipped
    assert clipped is not None  # param_coefficients asks only then
    dots = (table.dot_pre_post, table.dot_pre_pre) if (table.has_dots | ~clipped.has).all() else None
    across = num_calls > 1 and _call_sums_comparable(step, table, num_calls)
    bad = ~(table.grad.has & clipped.has) | (clipped.nonfinite > 0) | (table.grad.nonfinite > 0)
    keys, inverse = _unique_pairs(table.rank, table.param)

    def per_key(values: np.ndarray) -> np.ndarray:
        return np.bincount(inverse, weights=np.where(bad, 0.0, values), minlength=len(keys))

    pre = per_key(table.grad.sum_sq)
    every_value = dots is not None
    with np.errstate(divide="ignore", invalid="ignore"):
        last = (
            per_key(dots[0]) / per_key(dots[1])
            if dots is not None
            else np.sqrt(per_key(clipped.sum_sq) / pre)
        )
        before = np.stack([per_key(c.sum_sq) for c in table.calls], axis=1) if across else None
        ratios = None if before is None else np.column_stack([np.sqrt(before[:, 1:] / before[:, :-1]), last])
    measured = ~(np.bincount(inverse, weights=bad, minlength=len(keys)) > 0) & (pre > 0) & np.isfinite(last)
    rank, param = keys[measured, 0], keys[measured, 1]
    last_call = (rank, param, last[measured], np.zeros(rank.size, dtype=np.int64))
    if ratios is None:
        return last_call, None, every_value
    ratios = ratios[measured]
    ratios = np.where(np.isnan(ratios), 1.0, ratios)  # 0 / 0: a piece without gradient before two calls
    changed = np.abs(ratios - 1.0) > rtol * np.maximum(1.0, ratios)
    if (changed.sum(axis=1) > 1).any() or not (ratios <= 1 + rtol).all():
        return last_call, None, every_value
    call = np.where(changed.any(axis=1), changed.argmax(axis=1) + 1, 0)
    return last_call, (rank, param, ratios.prod(axis=1), call), every_value


def _call_sums_comparable(step: StepFacts, table: StepTable, num_calls: int) -> bool:
    """Whether every entry holds its sum of squares before each of the `num_calls` clip calls, and
    every rank holding entries clipped with one unscale_ state throughout (unscale_ between calls
    changes the gradients by more than the clip coefficient); within a rank the loss scale divided
    out of the sums is one number, which cancels in their ratios."""
    if len(table.calls) != num_calls or not all(c.has.all() for c in table.calls):
        return False
    clips = [step.ranks[rank].clip for rank in set(table.rank.tolist())]
    return all(clip is not None and len({c.unscaled for c in clip.calls}) == 1 for clip in clips)


def _cause(groups: list[CoefGroup], per_call: bool, rtol: float) -> tuple[list[CoefGroup], str | None]:
    """The groups with the power of the first group's coefficient each received, and the cause."""
    if len(groups) < 2:
        return groups, None
    if per_call:
        return groups, PER_CALL
    first = groups[0].coef
    powered = [groups[0]]
    for group in groups[1:]:
        power = 1
        if relative_difference(group.coef, 1.0) <= rtol and relative_difference(first, 1.0) > rtol:
            power = 0
        elif 0 < group.coef < first < 1:
            k = round(math.log(group.coef) / math.log(first))
            if 2 <= k <= 4 and relative_difference(group.coef, first**k) <= k * rtol:
                power = k
        powered.append(CoefGroup(coef=group.coef, params=group.params, ranks=group.ranks, power=power))
    powers = {g.power for g in powered[1:]}
    cause = LISTED_TWICE if any(p >= 2 for p in powers) else LEFT_OUT if powers == {0} else None
    return powered, cause


def _expected(diagnosis: StepDiagnosis, per_call: bool) -> float | None:
    """The coefficient of the true norm before the first clip call when the coefficients span the
    calls (the dumped pre-clip gradient is of the last call), else before the last."""
    if per_call and diagnosis.call_norms:
        return expected_coef_of(diagnosis.call_norms[0].norm, diagnosis.max_norm)
    return diagnosis.expected_coef


def _repeated_norm(table: StepTable, diagnosis: StepDiagnosis, groups: Sequence[CoefGroup]) -> float | None:
    """The L2 norm that counts each parameter of a powered group `power` times (once per listing)."""
    if diagnosis.true_norm is None or table.norm_type != 2.0:
        return None
    import numpy as np

    ids = {name: i for i, name in enumerate(table.param_names)}
    extra_times = np.zeros(len(ids))
    for group in groups:
        if group.power >= 2:
            extra_times[[ids[name] for name in group.params if name in ids]] += group.power - 1
    cover = table.cover
    cover = cover[table.grad.has[cover]]
    extra = safe_fsum(extra_times[table.param[cover]] * table.grad.sum_sq[cover])
    return math.sqrt(diagnosis.true_norm**2 + extra)
