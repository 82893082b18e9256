"""Folding the per-rank rows of a report into a bounded number of groups, shared by the human renderers.

Ranks whose rows would print identically fold into one row with a rank range. When that still leaves
too many rows (every rank's norm differs in the last digit), ranks fold by diagnosis, coefficient source
and nonfinite counts, and the numbers are shown as ranges. When even that is too many, the telling
groups are kept (nonfinite first, then diagnoses other than the common one, then the largest) and the
rest are counted. The JSON report always keeps every rank.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from ..checks.base import count
from ..report.model import NonfiniteCounts, RankRow
from .numbers import fmt_coef, fmt_float, fmt_nonfinite, fmt_percent, fmt_ranks


@dataclass(frozen=True, kw_only=True)
class RankGroup:
    """Ranks shown as one row; each number is a (min, max) over the group, equal when all agree."""

    ranks: tuple[int, ...]
    """The ranks of this row, ascending."""
    local_norm: tuple[float | None, float | None]
    """(min, max) of the ranks' local norms."""
    reported_norm: tuple[float | None, float | None]
    """(min, max) of the ranks' reported norms."""
    applied_clip_coef: tuple[float | None, float | None]
    """(min, max) of the ranks' applied coefficients."""
    share_of_squared_norm: tuple[float | None, float | None]
    """(min, max) of the ranks' shares of the squared global norm."""
    applied_coef_source: str | None
    """Where the coefficients came from (equal over the group)."""
    diagnosis: str | None
    """The ranks' diagnosis (equal over the group)."""
    nonfinite: NonfiniteCounts
    """The counts of every rank of the group (they are equal: the count is part of what groups them)."""


@dataclass(frozen=True, kw_only=True)
class FoldedRanks:
    groups: tuple[RankGroup, ...]
    """In order of each group's lowest rank."""
    hidden_ranks: tuple[int, ...] = ()
    """Ranks of groups left out to keep the table short."""
    num_hidden_groups: int = 0
    """Groups left out (their ranks are `hidden_ranks`)."""
    folded: bool = False
    """True when some row stands for more than one rank."""


def fold_ranks(rows: Sequence[RankRow], *, max_groups: int | None) -> FoldedRanks:
    """At most `max_groups` groups covering the telling ranks (see the module docstring); every rank on
    its own row with None (`--all-ranks`)."""
    if max_groups is None:
        return _folded([[row] for row in rows], [])
    if max_groups < 1:
        raise ValueError(f"max_groups must be at least 1, got {max_groups}")
    exact = _group(rows, _printed_row)
    if len(exact) <= max_groups:
        return _folded(exact, [])
    coarse = _group(rows, lambda r: (r.diagnosis, r.applied_coef_source, _nonfinite_key(r.nonfinite)))
    if len(coarse) <= max_groups:
        return _folded(coarse, [])
    common = Counter(row.diagnosis for row in rows).most_common(1)[0][0]
    ranked = sorted(
        coarse,
        key=lambda g: (g[0].nonfinite.total == 0, g[0].diagnosis == common, -len(g), g[0].rank),
    )
    return _folded(ranked[:max_groups], ranked[max_groups:])


def fmt_span(span: tuple[float | None, float | None], fmt: Callable[[float | None], str] = fmt_float) -> str:
    """ "0.8", or "0.79–0.81" when the group's values differ; "-" when unknown."""
    low, high = (fmt(value) for value in span)
    if low == high:
        return low
    return f"{low}–{high}"


def fmt_rank_set(ranks: Sequence[int], *, max_chars: int = 48) -> str:
    """Compact ranks ("0-3, 7"), cut at a comma when longer than `max_chars`: "0, 2, 4, … (2048 ranks)"."""
    text = fmt_ranks(ranks)
    if len(text) <= max_chars:
        return text
    cut = text.rfind(", ", 0, max_chars)
    head = text[:cut] if cut > 0 else text[:max_chars]
    return f"{head}, … ({len(set(ranks))} ranks)"


def fmt_ranks_labelled_short(ranks: Sequence[int], *, max_chars: int = 48) -> str:
    """ "rank 3" or "ranks 0-3, 7", cut like `fmt_rank_set`."""
    return f"{'rank' if len(set(ranks)) == 1 else 'ranks'} {fmt_rank_set(ranks, max_chars=max_chars)}"


def fmt_hidden(folded: FoldedRanks) -> str:
    """ "3 more ranks in 2 groups not shown (ranks 5-7)": the ranks of the groups left out."""
    hidden = f"{count(len(folded.hidden_ranks), 'more rank')} in {count(folded.num_hidden_groups, 'group')}"
    return f"{hidden} not shown (ranks {fmt_rank_set(folded.hidden_ranks)})"


def fmt_groups(groups: Sequence[Sequence[int]], *, max_groups: int = 4) -> str:
    """Process groups as text: "2 groups of 2 ranks: {0-1}, {2-3}", the first few shown."""
    if not groups:
        return "no groups"
    sizes = sorted({len(g) for g in groups})
    size_text = f"{sizes[0]} to {sizes[-1]} ranks" if len(sizes) > 1 else count(sizes[0], "rank")
    shown = ", ".join(f"{{{fmt_rank_set(g, max_chars=32)}}}" for g in groups[:max_groups])
    more = ", …" if len(groups) > max_groups else ""
    return f"{count(len(groups), 'group')} of {size_text}: {shown}{more}"


def group_cells(group: RankGroup) -> tuple[str, str, str, str, str]:
    """(local norm, reported norm, applied coef, share of Σg², nonfinite) as printed."""
    return (
        fmt_span(group.local_norm),
        fmt_span(group.reported_norm),
        fmt_span(group.applied_clip_coef, fmt_coef),
        fmt_span(group.share_of_squared_norm, fmt_percent),
        fmt_nonfinite(group.nonfinite),
    )


def _printed_row(row: RankRow) -> Hashable:
    return (
        fmt_float(row.local_norm),
        fmt_float(row.reported_norm),
        fmt_coef(row.applied_clip_coef),
        fmt_percent(row.share_of_squared_norm),
        row.applied_coef_source,
        row.diagnosis,
        _nonfinite_key(row.nonfinite),
    )


def _nonfinite_key(counts: NonfiniteCounts) -> tuple[int, int, int]:
    return (counts.nan, counts.posinf, counts.neginf)


def _group(rows: Sequence[RankRow], key: Callable[[RankRow], Hashable]) -> list[list[RankRow]]:
    groups: dict[Hashable, list[RankRow]] = {}
    for row in rows:
        groups.setdefault(key(row), []).append(row)
    return list(groups.values())


def _folded(shown: list[list[RankRow]], hidden: list[list[RankRow]]) -> FoldedRanks:
    groups = sorted((_summarize(rows) for rows in shown), key=lambda g: g.ranks[0])
    return FoldedRanks(
        groups=tuple(groups),
        hidden_ranks=tuple(sorted(row.rank for rows in hidden for row in rows)),
        num_hidden_groups=len(hidden),
        folded=any(len(g.ranks) > 1 for g in groups),
    )


def _summarize(rows: list[RankRow]) -> RankGroup:
    first = rows[0]
    return RankGroup(
        ranks=tuple(sorted(row.rank for row in rows)),
        local_norm=_span(row.local_norm for row in rows),
        reported_norm=_span(row.reported_norm for row in rows),
        applied_clip_coef=_span(row.applied_clip_coef for row in rows),
        share_of_squared_norm=_span(row.share_of_squared_norm for row in rows),
        applied_coef_source=first.applied_coef_source,
        diagnosis=first.diagnosis,
        nonfinite=first.nonfinite,
    )


def _span(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """(min, max) of the known values; a nan anywhere shows as nan, any unknown value as unknown."""
    known: list[float] = []
    for value in values:
        if value is None:
            return (None, None)
        known.append(float(value))
    if any(math.isnan(v) for v in known):
        return (math.nan, math.nan)
    return (min(known), max(known))
