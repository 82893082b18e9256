"""A guarded run's trend as lines of text, shared by the terminal and Markdown renderers: the failing
steps first, those the guard did not dump, then the true vs reported norm of the last checked steps."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..checks.base import count
from ..report.model import GuardTrend, TrendStep
from .numbers import fmt_coef, fmt_float, fmt_steps_named

SHOWN_FAILING = 12
"""Failing steps listed one per line; the JSON report lists every one."""
BAR_WIDTH = 40
NOT_DUMPED_REASON = "guard max_dumps or cooldown"

Escape = Callable[[str], str]


def headline(trend: GuardTrend) -> str:
    """ "guard trend: 20 checked steps, 4 with wrong clipping, 1 skipped by the scaler"."""
    skipped = f", {trend.num_skipped} skipped by the scaler" if trend.num_skipped else ""
    newest = "the newest " if trend.num_unread else ""
    return (
        f"guard trend: {newest}{count(trend.num_checked, 'checked step')}, "
        f"{len(trend.failing)} with wrong clipping{skipped}{spikes_counted(trend, ', ')}"
    )


def spikes_counted(trend: GuardTrend, before: str = "") -> str:
    """ "2 spikes of the true norm" after `before`; "" when no step spiked."""
    return f"{before}{count(len(trend.spikes), 'spike')} of the true norm" if trend.spikes else ""


def spike_step(step: TrendStep, escape: Escape) -> str:
    """ "spike at step 7: true norm 53.2, reported 53.2; where Σg² is: gradaudit check audit/step_7"."""
    where = (
        f"not dumped ({NOT_DUMPED_REASON})"
        if step.dump is None
        else f"which parameters hold Σg²: gradaudit check {escape(step.dump)}"
    )
    return f"spike at step {step.step}: {spike_numbers(step)}; {where}"


def spike_numbers(step: TrendStep) -> str:
    """ "true norm 53.2, reported 53.2": a spike's coefficients say nothing of it."""
    return f"true norm {fmt_float(step.true_norm)}, reported {fmt_float(step.reported_norm)}"


def more(steps: Sequence[TrendStep], noun: str) -> str:
    """The line under the listed steps (failing, or spikes) that counts the others: "(and 2 `noun`s)";
    "" when every one is listed."""
    hidden = len(steps) - SHOWN_FAILING
    return f"(and {count(hidden, noun)})" if hidden > 0 else ""


def all_clean(trend: GuardTrend) -> str:
    """The sentence of a guarded run without a failing step."""
    if trend.num_skipped:
        clean = f"{trend.num_clean} clean, {trend.num_skipped} skipped by the scaler (nothing clipped)"
        return f"{count(trend.num_checked, 'step')} checked: {clean}; none with wrong clipping."
    if trend.num_checked == 1:
        return "1 step checked, clean."
    return f"{trend.num_checked} steps checked, all clean."


def failing_step(step: TrendStep, escape: Escape) -> str:
    """ "step 3: GA201 (true norm 1.6, reported 0.8, coefficients 1..1)"."""
    return f"step {step.step}: {', '.join(escape(code) for code in step.codes)} ({numbers(step)})"


def numbers(step: TrendStep) -> str:
    parts = [f"true norm {fmt_float(step.true_norm)}", f"reported {fmt_float(step.reported_norm)}"]
    if step.min_coef is not None and step.max_coef is not None:
        by = f" applied by the last of {step.clip_calls} clip calls" if step.clip_calls > 1 else ""
        parts.append(f"coefficients{by} {fmt_coef(step.min_coef)}..{fmt_coef(step.max_coef)}")
    return ", ".join(parts)


def not_dumped(trend: GuardTrend) -> str:
    """The failing steps the guard warned about without a dump; "" when it dumped every one."""
    steps = trend.not_dumped
    if not steps:
        return ""
    return (
        f"{count(len(steps), 'failing step')} not dumped ({NOT_DUMPED_REASON}): "
        f"{fmt_steps_named(steps)}; only the trend has {'it' if len(steps) == 1 else 'them'}"
    )


def full_capture(directory: str, escape: Escape) -> str:
    name = directory.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].replace("_", " ")
    return f"{escape(name)} captured in full (the step after an anomaly): gradaudit check {escape(directory)}"


def chart_title(trend: GuardTrend) -> str:
    return f"true (#) vs reported (|) norm, last {count(len(trend.chart), 'checked step')}:"


def chart_rows(trend: GuardTrend, escape: Escape) -> list[str]:
    """One row per charted step: its number, the bars, the two norms and what was wrong; [] when no
    charted step has a finite positive norm to scale the bars by."""
    top = max(
        (
            value
            for step in trend.chart
            for value in (step.true_norm, step.reported_norm)
            if value is not None and math.isfinite(value)
        ),
        default=0.0,
    )
    if top <= 0:
        return []
    width = max(len(str(step.step)) for step in trend.chart)
    return [
        f"{step.step:>{width}} {_bar(step.true_norm, step.reported_norm, top)} "
        f"{fmt_float(step.true_norm)} / {fmt_float(step.reported_norm)}{_mark(step, escape)}"
        for step in trend.chart
    ]


def _mark(step: TrendStep, escape: Escape) -> str:
    spike = "  spike" if step.spike else ""
    if step.verdict == "skipped":
        return "  skipped by the scaler" + spike
    return ("  " + ",".join(escape(code) for code in step.codes) if step.codes else "") + spike


def _bar(true: float | None, reported: float | None, top: float) -> str:
    """The true norm as a run of #, the reported one as a | at its length (over the # when shorter)."""
    cells = [" "] * BAR_WIDTH
    if true is not None and math.isfinite(true):
        filled = min(BAR_WIDTH, round(BAR_WIDTH * true / top))
        cells[:filled] = ["#"] * filled
    if reported is not None and math.isfinite(reported):
        at = min(BAR_WIDTH, round(BAR_WIDTH * reported / top))
        if at > 0:
            cells[at - 1] = "|"
    return "".join(cells)
