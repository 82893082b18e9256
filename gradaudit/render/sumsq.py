"""A spike dump's parameters holding most of Σg², as lines of text shared by the terminal and Markdown
renderers (the JSON report holds `Report.sum_sq_shares` as it is)."""

from __future__ import annotations

from collections.abc import Callable

from ..checks.base import count
from ..report.param_shares import SumSqShares
from .numbers import fmt_float, fmt_percent

TITLE = "Parameters holding most of Σg²"
MAX_SHOWN_IN_LINE = 3
"""Parameters a one-line summary (a failing step's brief) names."""

Escape = Callable[[str], str]


def totals(shares: SumSqShares) -> str:
    """ "total 2830.5 in 12 parameters"."""
    return f"total {fmt_float(shares.sum_sq)} in {count(shares.num_params, 'parameter')}"


def why(shares: SumSqShares, escape: Escape) -> str:
    """ "the guard dumped this step at a spike of its true norm: true norm 53 is 12x the median ..."."""
    said = "the guard dumped this step at a spike of its true norm"
    return f"{said}: {escape(shares.note)}" if shares.note else said


def rest(shares: SumSqShares) -> str:
    """ "the other 9 parameters hold 19.0%"; "" when every parameter is shown."""
    hidden = shares.num_params - len(shares.top)
    if hidden <= 0 or not shares.top:
        return ""
    left = max(0.0, 1.0 - sum(s.share for s in shares.top))
    other = "the other parameter holds" if hidden == 1 else f"the other {hidden} parameters hold"
    return f"{other} {fmt_percent(left)}"


def sentence(shares: SumSqShares, escape: Escape, most: int = MAX_SHOWN_IN_LINE) -> str:
    """ "72.0% of Σg² in layers.11.mlp.w2, 9.0% in layers.10.mlp.w2", or why no share is known."""
    if not shares.top:
        return shares.reason
    first, *others = shares.top[:most]
    parts = [f"{fmt_percent(first.share)} of Σg² in {escape(first.param)}"]
    parts += [f"{fmt_percent(s.share)} in {escape(s.param)}" for s in others]
    return ", ".join(parts)
