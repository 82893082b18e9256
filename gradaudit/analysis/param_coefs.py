"""The clip coefficient each parameter received, from its pre- and post-clip gradients: parameters
grouped by the coefficient they share, and what a step whose parameters received several shows (a
parameter scaled twice, one clip call per parameter group) (pure: works on measurements only)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..measure.columns import StepColumns
from ..measure.measurements import StepMeasurements
from ..model import StepDump
from ..norms import expected_clip_coef, relative_difference, safe_fsum
from .diagnosis import StepDiagnosis, disjoint_cover

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
    """What the true norm of the gradient before the first clip call asks for."""
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


def param_coefficients(
    step: StepDump, m: StepMeasurements, diagnosis: StepDiagnosis, columns: StepColumns
) -> ParamCoefficients:
    """The step's per-parameter coefficients (none, with a note, when they cannot be measured; none
    without a note when fewer than two parameters have a nonzero finite gradient)."""
    num_calls = diagnosis.num_clip_calls
    if diagnosis.mixed_moments:
        return ParamCoefficients(
            note=f"the dump holds the gradient from before the first of {num_calls} clip calls and the "
            "clipped one from after the last, without per-call statistics"
        )
    if not columns.has_clipped.any():
        return ParamCoefficients(note="post-clip gradients (grad_clipped) were not dumped")
    rtol = diagnosis.rtol
    last_call, spanning, by_values = _per_rank_and_param(step, m, num_calls, rtol)
    measured = last_call if spanning is None else spanning
    per_call = spanning is not None
    names = sorted({param for _, param in measured})
    if len(names) < 2:
        return ParamCoefficients()
    by_param: dict[str, list[tuple[int, float, int | None]]] = {}
    for (rank, param), (coef, call) in sorted(measured.items()):
        by_param.setdefault(param, []).append((rank, coef, call))
    disagreeing = tuple(
        p for p, found in by_param.items() if len(clusters(((r, c) for r, c, _ in found), rtol)) > 1
    )
    ids = {name: i for i, name in enumerate(names)}
    grouped = clusters(((ids[p], found[0][1]) for p, found in by_param.items()), rtol)
    # The most parameters first; of as many, a coefficient below 1 before 1, the larger before the
    # smaller: the others' coefficient a parameter left out (1) or scaled twice (c²) departs from.
    grouped.sort(key=lambda g: (-len(g), relative_difference(g[0][1], 1.0) <= rtol, -g[0][1]))
    groups = [
        CoefGroup(
            coef=members[0][1],
            params=tuple(sorted(names[i] for i, _ in members)),
            ranks=tuple(sorted({r for i, _ in members for r, _, _ in by_param[names[i]]})),
            calls=tuple(sorted({c for i, _ in members for _, _, c in by_param[names[i]] if c is not None})),
        )
        for members in grouped
    ]
    held: dict[int, list[tuple[int, float]]] = {}
    for (rank, param), (coef, _) in measured.items():
        held.setdefault(rank, []).append((ids[param], coef))
    mixed = tuple(sorted(r for r, values in held.items() if len(clusters(values, rtol)) > 1))
    groups, cause = _cause(groups, per_call, rtol)
    return ParamCoefficients(
        groups=tuple(groups),
        mixed_ranks=mixed,
        disagreeing=disagreeing,
        expected_coef=_expected(diagnosis, per_call),
        cause=cause,
        by_values=by_values,
        repeated_norm=_repeated_norm(m, diagnosis, groups) if cause == LISTED_TWICE else None,
        moment="" if per_call else diagnosis.moment,
    )


Coefficients = dict[tuple[int, str], tuple[float, int | None]]
"""(rank, parameter) -> (coefficient, the 1-based clip call that changed it or None)."""


def _per_rank_and_param(
    step: StepDump, m: StepMeasurements, num_calls: int, rtol: float
) -> tuple[Coefficients, Coefficients | None, bool]:
    """(the last clip call's coefficients, the coefficients across every call, whether every one was
    measured from the values). With several calls, a coefficient spans them only when each parameter
    was changed by one call at most, and only by a scaling (None otherwise: the gradients changed
    between the calls, as a backward pass between them does, GA501)."""
    sums: dict[tuple[int, str], list[float]] = {}
    left_out: set[tuple[int, str]] = set()
    every_value = True
    calls = _call_sums(step) if num_calls > 1 else {}
    for piece in m.pieces:
        pre, post = piece.stats.get("grad"), piece.stats.get("grad_clipped")
        key = (piece.rank, piece.param)
        if pre is None or post is None or pre.num_nonfinite or post.num_nonfinite:
            left_out.add(key)
            continue
        values = piece.dot_pre_post is not None and piece.dot_pre_pre is not None
        every_value &= values
        per_call = calls.get((piece.rank, piece.index), ())
        if len(per_call) != num_calls:
            per_call = (math.nan,) * num_calls  # no per-call statistics: no coefficient spans the calls
        row = sums.setdefault(key, [0.0] * (4 + len(per_call)))
        dots = (piece.dot_pre_post or 0.0, piece.dot_pre_pre or 0.0) if values else (0.0, 0.0)
        for i, value in enumerate((*dots, post.sum_sq, pre.sum_sq, *per_call)):
            row[i] += value
    last_call: Coefficients = {}
    spanning: Coefficients | None = {} if num_calls > 1 else None
    for key, row in sums.items():
        if key in left_out:
            continue
        dot_post, dot_pre, post_sq, pre_sq, *before_calls = row
        if not pre_sq > 0:
            continue
        last = dot_post / dot_pre if every_value and dot_pre > 0 else math.sqrt(post_sq / pre_sq)
        last_call[key] = (last, None)
        if spanning is None:
            continue
        ratios = [_ratio(a, b) for a, b in itertools.pairwise(before_calls)] + [last]
        changed = [k for k, r in enumerate(ratios) if relative_difference(r, 1.0) > rtol]
        if len(changed) > 1 or any(not r <= 1 + rtol for r in ratios):
            spanning = None
        else:
            spanning[key] = (math.prod(ratios), changed[0] + 1 if changed else None)
    return last_call, spanning, every_value


def _ratio(before: float, after: float) -> float:
    """The coefficient that turned a sum of squares `before` into `after` (inf when a gradient appeared)."""
    if before > 0:
        return math.sqrt(after / before)
    return 1.0 if after == 0 else math.inf


def _call_sums(step: StepDump) -> dict[tuple[int, int], tuple[float, ...]]:
    """(rank, piece index) -> the piece's gradient sum of squares before each clip call (raw: the loss
    scale cancels in their ratios), for the pieces that hold per-call statistics."""
    from ..dumpfile.columnar import ColumnarPieces

    found = {}
    for rank in step.ranks_present:
        dump = step.ranks[rank]
        clip = dump.clip
        if (
            clip is None
            or len({c.unscaled for c in clip.calls}) > 1
            or isinstance(dump.pieces, ColumnarPieces)
        ):
            continue  # unscale_ between calls changes the gradients by more than the clip coefficient
        for piece in dump.pieces:
            if piece.call_stats:
                found[(rank, piece.index)] = tuple(s.sum_sq for s in piece.call_stats)
    return found


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
    if diagnosis.max_norm is None:
        return None
    if per_call and diagnosis.call_norms:
        first = diagnosis.call_norms[0].norm
        return None if first is None else expected_clip_coef(first, diagnosis.max_norm)
    return diagnosis.expected_coef


def _repeated_norm(
    m: StepMeasurements, diagnosis: StepDiagnosis, groups: Sequence[CoefGroup]
) -> float | None:
    """The L2 norm that counts each parameter of a powered group `power` times (once per listing)."""
    if diagnosis.true_norm is None or m.norm_type != 2.0:
        return None
    extra = safe_fsum(
        (group.power - 1) * piece.stats["grad"].sum_sq
        for group in groups
        if group.power >= 2
        for name in group.params
        for piece in disjoint_cover(m.params[name].pieces)
        if "grad" in piece.stats
    )
    return math.sqrt(diagnosis.true_norm**2 + extra)
