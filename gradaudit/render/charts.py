"""The pictures of a report, shared by the renderers: each rank's part of the squared norm against
max_norm² (terminal bars, a Mermaid bar chart in Markdown) and a run folder's true vs reported norm per
step (a Mermaid line chart). GitHub draws Mermaid `xychart-beta` blocks in issues; a table beside each
chart carries the same numbers for renderers that do not draw it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..norms import norm_name
from ..report.model import MultiStepReport, Report, first_call_numbers
from .numbers import fmt_float

MAX_CHART_RANKS = 16
MAX_TREND_STEPS = 48


@dataclass(frozen=True, kw_only=True)
class ShareBar:
    label: str
    """"rank N", or "all ranks" for the total."""
    value: float
    """This rank's part of the squared global norm (the total for "all ranks")."""
    share: float
    """`value` as a fraction of the squared global norm."""


@dataclass(frozen=True, kw_only=True)
class ShareChart:
    total: float
    """The squared global norm."""
    threshold: float
    """max_norm²."""
    bars: tuple[ShareBar, ...]
    """The largest ranks in rank order, then "all ranks"."""
    num_hidden: int
    """Ranks left out of the bars to keep the chart short."""


def share_chart(report: Report, *, limit: int = MAX_CHART_RANKS) -> ShareChart | str:
    """The share chart of a step, or why there is none."""
    # RankRow.share_of_squared_norm is a share of Σg², so the chart is only meaningful for the L2 norm.
    if report.norm_type != 2:
        return f"drawn for the L2 norm only; this step clips the {norm_name(report.norm_type)}"
    norm, max_norm = report.global_norm, report.max_norm
    if norm is None or max_norm is None or not math.isfinite(norm) or not math.isfinite(max_norm):
        return "max_norm or the global norm is unknown or not finite"
    if max_norm <= 0:
        return "max_norm must be positive"
    if not report.ranks:
        return "no rank could be read"
    total = norm * norm  # inf, not OverflowError, past float64
    bars = [
        ShareBar(
            label=f"rank {row.rank}", value=row.share_of_squared_norm * total, share=row.share_of_squared_norm
        )
        for row in report.ranks
    ]
    shown, num_hidden = _largest_in_rank_order(bars, limit)
    shown.append(ShareBar(label="all ranks", value=total, share=1.0))
    return ShareChart(total=total, threshold=max_norm * max_norm, bars=tuple(shown), num_hidden=num_hidden)


def _largest_in_rank_order(bars: list[ShareBar], limit: int) -> tuple[list[ShareBar], int]:
    """The `limit` bars with the largest values, kept in rank order, and how many were left out."""
    if len(bars) <= limit:
        return list(bars), 0
    largest = sorted(range(len(bars)), key=lambda i: -bars[i].value)[:limit]
    return [bars[i] for i in sorted(largest)], len(bars) - limit


def mermaid_share_chart(chart: ShareChart) -> str:
    """A Mermaid bar chart of `chart`, max_norm² drawn as a line across it."""
    if not all(math.isfinite(bar.value) for bar in chart.bars):
        return ""
    top = max([chart.threshold, *(bar.value for bar in chart.bars)])
    labels = ", ".join(f'"{bar.label}"' for bar in chart.bars)
    return _mermaid(
        [
            'title "Part of the squared global norm (bars) against max_norm² (line)"',
            f"x-axis [{labels}]",
            f'y-axis "Σg²" 0 --> {_num(top * 1.05)}',
            "bar [" + ", ".join(_num(bar.value) for bar in chart.bars) + "]",
            "line [" + ", ".join(_num(chart.threshold) for _ in chart.bars) + "]",
        ]
    )


@dataclass(frozen=True, kw_only=True)
class TrendPoint:
    step: int
    """The optimizer step."""
    true_norm: float
    """The global norm the audit recomputed."""
    reported_norm: float
    """The norm the training code reported."""
    failing: bool
    """Whether the step has errors, warnings or missing ranks."""
    clip_calls: int = 1
    """The step's clip calls; above 1, both norms are those at the first (as in the run table)."""


def trend_points(
    multi: MultiStepReport, failing: set[int], *, limit: int = MAX_TREND_STEPS
) -> list[TrendPoint]:
    """The steps with a known true and reported norm, every failing one kept, the clean ones thinned
    evenly when there are more than `limit` in all. The norms are the summary's (`first_call_numbers`)."""
    calls = {report.step: first_call_numbers(report).clip_calls for report in multi.steps}
    points = [
        TrendPoint(
            step=s.step,
            true_norm=s.global_norm,
            reported_norm=s.reported_norm,
            failing=s.step in failing,
            clip_calls=calls.get(s.step, 1),
        )
        for s in multi.summary
        if s.global_norm is not None
        and s.reported_norm is not None
        and math.isfinite(s.global_norm)
        and math.isfinite(s.reported_norm)
    ]
    if len(points) <= limit:
        return points
    kept = [p for p in points if p.failing][:limit]
    clean = [p for p in points if not p.failing]
    room = limit - len(kept)
    if room > 0 and clean:
        stride = len(clean) / room
        kept += [clean[int(i * stride)] for i in range(min(room, len(clean)))]
    return sorted(kept, key=lambda p: p.step)


def mermaid_trend_chart(points: Sequence[TrendPoint], max_norm: float | None) -> str:
    """A Mermaid line chart of the true and reported norm per step; failing steps' labels carry ✗."""
    if len(points) < 2:
        return ""
    lines = [[p.true_norm for p in points], [p.reported_norm for p in points]]
    if max_norm is not None and math.isfinite(max_norm):
        lines.append([max_norm] * len(points))
    labels = ", ".join(f'"{p.step}{" ✗" if p.failing else ""}"' for p in points)
    return _mermaid(
        [
            'title "True norm (1st line), reported norm (2nd)'
            + (", max_norm (3rd)" if len(lines) == 3 else "")
            + ' per step; ✗ marks a failing step"',
            f"x-axis [{labels}]",
            f'y-axis "norm" 0 --> {_num(max(v for line in lines for v in line) * 1.05)}',
            *("line [" + ", ".join(_num(v) for v in line) + "]" for line in lines),
        ]
    )


def _num(value: float) -> str:
    return fmt_float(value) if value != 0 else "0"


def _mermaid(lines: Sequence[str]) -> str:
    body = "\n".join(f"    {line}" for line in lines)
    return f"```mermaid\nxychart-beta\n{body}\n```"
