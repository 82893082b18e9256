"""The rows of a run folder's summary, shared by the human renderers: failing steps first, one row each,
then the clean steps folded into runs (the steps between two failing ones share a row)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import groupby

from ..report.model import MultiStepReport, Report, Severity, StepSummary, first_call_numbers

Span = tuple[float | None, float | None]


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One row of the summary: a failing step, or a run of clean steps with its numbers as (min, max)."""

    steps: tuple[int, ...]
    """The steps of this row: one failing step, or a run of clean ones."""
    reported_norm: Span
    """(min, max) of the reported norms over the steps."""
    global_norm: Span
    """(min, max) of the recomputed global norms."""
    ratio: Span
    """(min, max) of reported / global norm."""
    expected_clip_coef: Span
    """(min, max) of the coefficients correct clipping applies."""
    num_errors: int
    """Error findings over the steps."""
    num_warnings: int
    """Warning findings over the steps."""
    codes: tuple[str, ...]
    """The distinct finding codes over the steps, sorted."""
    failing: bool
    """Whether the row is a failing step (see `is_failing`)."""
    clip_calls: int = 1
    """A failing step's clip calls; above 1, the norms and `expected_clip_coef` are those at the first
    of them (StepSummary's, see `first_call_numbers`)."""


def is_failing(report: Report) -> bool:
    """A step with an error or warning finding, a missing rank or a reading warning; info alone is clean."""
    return bool(
        report.missing_ranks
        or report.warnings
        or any(f.severity is not Severity.INFO for f in report.findings)
    )


def step_rows(multi: MultiStepReport, *, failing_only: bool = False) -> tuple[list[StepRow], list[int]]:
    """(the rows, the clean steps left out): failing steps first, in step order, then runs of clean
    steps (all left out with `failing_only`)."""
    failing = {
        report.step: first_call_numbers(report).clip_calls for report in multi.steps if is_failing(report)
    }
    rows = [
        replace(_row([s], failing=True), clip_calls=failing[s.step])
        for s in multi.summary
        if s.step in failing
    ]
    runs = [list(run) for fails, run in groupby(multi.summary, lambda s: s.step in failing) if not fails]
    clean = [s.step for run in runs for s in run]
    if failing_only:
        return rows, clean
    return rows + [_row(run, failing=False) for run in runs], []


def fmt_steps(steps: Sequence[int]) -> str:
    """ "1200", or "1100–1900 (9 steps)" for a run."""
    if len(steps) == 1:
        return str(steps[0])
    return f"{steps[0]}–{steps[-1]} ({len(steps)} steps)"


def _row(run: Sequence[StepSummary], *, failing: bool) -> StepRow:
    return StepRow(
        steps=tuple(s.step for s in run),
        reported_norm=_span(s.reported_norm for s in run),
        global_norm=_span(s.global_norm for s in run),
        ratio=_span(_ratio(s.reported_norm, s.global_norm) for s in run),
        expected_clip_coef=_span(s.expected_clip_coef for s in run),
        num_errors=sum(s.num_errors for s in run),
        num_warnings=sum(s.num_warnings for s in run),
        codes=tuple(sorted({code for s in run for code in s.codes})),
        failing=failing,
    )


def first_call_notes(rows: Iterable[StepRow]) -> list[str]:
    """One line under the summary per number of clip calls, naming the rows whose norms and expected
    coefficient are those at the first call."""
    steps_by_calls: dict[int, list[str]] = {}
    for row in rows:
        if row.clip_calls > 1:
            steps_by_calls.setdefault(row.clip_calls, []).append(fmt_steps(row.steps))
    return [
        f"step {steps[0]}: reported norm, true norm and expected coef at the first of its {calls} clip "
        "calls; its own report gives the true norm before the last"
        if len(steps) == 1
        else f"steps {', '.join(steps)}: reported norm, true norm and expected coef at the first of their "
        f"{calls} clip calls; their own reports give the true norm before the last"
        for calls, steps in steps_by_calls.items()
    ]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def _span(values: Iterable[float | None]) -> Span:
    """(min, max) of the known values; (None, None) when none is known; nan when any is nan."""
    known = [float(v) for v in values if v is not None]
    if not known:
        return (None, None)
    if any(math.isnan(v) for v in known):
        return (math.nan, math.nan)
    return (min(known), max(known))
