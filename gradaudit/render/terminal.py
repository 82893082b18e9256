"""Terminal rendering of an audit report (rich): verdict first, then ranks, the norm chart and the findings.

Every line is assembled from rich `Text` pieces, never from markup strings, so an untrusted name is not
parsed at all: `[red]` stays text, even next to a style or at the end of a cell (where a markup-escaped
trailing backslash would be ambiguous). Untrusted text also goes through `printable`, which makes
control characters (ANSI escapes, newlines) visible.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..checks.base import count
from ..norms import norm_name
from ..report.model import Finding, GuardTrend, MultiStepReport, Report, Severity
from . import guardtrend, sumsq
from .charts import MAX_CHART_RANKS, share_chart
from .fold import fmt_hidden, fmt_rank_set, fmt_ranks_labelled_short, fmt_span, fold_ranks, group_cells
from .numbers import (
    diagnosis_label,
    fmt_coef,
    fmt_finding_counts,
    fmt_float,
    fmt_percent,
    fmt_replica_of,
    fmt_steps_named,
    fmt_value,
    reference_worst_first,
    replica_owners,
    unsaid_diagnosis_groups,
)
from .steps import StepRow, first_call_notes, fmt_steps, is_failing, step_rows
from .text import clip_text, join_limited, printable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

MAX_PARAMS_SHOWN = 8
MAX_RANK_ROWS = 32
MAX_DETAIL_LINES = 8
MAX_REFERENCE_ROWS = 10
MAX_WARNINGS = 20
THRESHOLD_MARK = "│"

_SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
_SYMBOL = {Severity.ERROR: "✗", Severity.WARNING: "!", Severity.INFO: "✓", None: "✓"}

Piece = str | tuple[str, str]
"""A piece of a line: plain text, or (text, style). Never markup."""


def render_report(report: Report, *, width: int = 100, color: bool = False, fold: bool = True) -> str:
    """The report for a terminal; `fold=False` prints every rank on its own row."""
    out = io.StringIO()
    console = make_console(out, width, color)
    _print_report(console, report, bar_width=_bar_width(width), fold=fold)
    return _strip_line_ends(out.getvalue())


def render_multi(
    multi: MultiStepReport, *, width: int = 100, color: bool = False, failing_only: bool = False
) -> str:
    """A folder of steps: a guarded run's trend first, then the failing steps first, clean steps folded
    into runs (left out with `failing_only`)."""
    out = io.StringIO()
    console = make_console(out, width, color)
    if multi.guard_trend is not None:
        print_guard_trend(console, multi.guard_trend)
        if not multi.steps:
            return _strip_line_ends(out.getvalue())
        console.print()
    failing = [r for r in multi.steps if is_failing(r)]
    console.print(
        _line(
            ("gradaudit", "bold"),
            f" · {count(len(multi.steps), 'step')} ({len(failing)} failing) in {printable(multi.directory)}",
        )
    )
    console.print()
    rows, hidden = step_rows(multi, failing_only=failing_only)
    if rows:
        console.print(_summary_table(rows))
        for note in first_call_notes(rows):
            _print_aside(console, note)
    for report in failing:
        console.print()
        console.rule(_line(f"step {report.step}"), align="left", characters="─")
        _print_step_brief(console, report)
    clean = [r.step for r in multi.steps if not is_failing(r)]
    if clean:
        console.print()
        console.print(_line(f"No errors, warnings or missing ranks in {fmt_steps_named(clean)}."))
    if hidden:
        _print_aside(console, f"{count(len(hidden), 'clean step')} not listed (--failing-only)")
    return _strip_line_ends(out.getvalue())


def print_guard_trend(console: Console, trend: GuardTrend, *, chart: bool = True) -> None:
    """The guard's verdicts during training: failing steps first, then the norms of the last steps."""
    console.print(_line((guardtrend.headline(trend), "bold")))
    for note in trend.notes:  # not wrapped, as the stderr line of the same warning
        console.print(_line("  ", ("warning:", "yellow"), f" {printable(note)}"), soft_wrap=True)
    for step in trend.failing[: guardtrend.SHOWN_FAILING]:
        console.print(
            _line(
                "  ",
                (guardtrend.failing_step(step, printable), "red"),
                (" · not dumped" if step.dump is None else "", "yellow"),
            )
        )
    _print_aside(console, guardtrend.more(trend.failing, "more failing step"))
    if trend.not_dumped:
        console.print(_line("  ", (guardtrend.not_dumped(trend), "yellow")))
    for step in trend.spikes[: guardtrend.SHOWN_FAILING]:  # not wrapped: the command in it is copied whole
        console.print(_line("  ", (guardtrend.spike_step(step, printable), "magenta")), soft_wrap=True)
    _print_aside(console, guardtrend.more(trend.spikes, "more spike"))
    rows = guardtrend.chart_rows(trend, printable) if chart else []
    if rows:
        console.print(_line(f"  {guardtrend.chart_title(trend)}"))
        for row in rows:
            console.print(_line(f"  {row}"))
    for directory in trend.full_captures:  # not wrapped: the command in it is copied whole
        _print_aside(console, guardtrend.full_capture(directory, printable), soft_wrap=True)
    if not trend.failing:
        console.print(_line((f"✓ {guardtrend.all_clean(trend)}", "bold green")))


def make_console(out: io.StringIO, width: int, color: bool) -> Console:
    """A rich Console writing to `out`, every setting explicit."""
    from rich.console import Console

    # Every setting explicit, so that the environment (FORCE_COLOR, COLUMNS, a tty) cannot change the output.
    return Console(
        file=out,
        width=width,
        color_system="standard" if color else None,
        force_terminal=color,
        force_jupyter=False,
        highlight=False,
        emoji=False,
        legacy_windows=False,
        soft_wrap=False,
    )


def _strip_line_ends(text: str) -> str:
    # rich pads table lines to the full width; trailing blanks only make goldens and pastes noisy.
    return "\n".join(line.rstrip() for line in text.split("\n"))


def _line(*pieces: Piece) -> Text:
    from rich.text import Text

    return Text.assemble(*pieces)


def _lines(*lines: Sequence[Piece]) -> Text:
    from rich.text import Text

    return Text("\n").join(_line(*pieces) for pieces in lines)


def _print_aside(console: Console, text: str, *, soft_wrap: bool = False) -> None:
    """An indented dim line; nothing when `text` is empty."""
    if text:
        console.print(_line((f"  {text}", "dim")), soft_wrap=soft_wrap)


def _bar_width(width: int) -> int:
    return max(10, min(50, width - 45))


def _print_report(console: Console, report: Report, *, bar_width: int, fold: bool) -> None:
    _print_verdict(console, report)
    _print_missing(console, report)
    console.print()
    _print_ranks(console, report, fold=fold)
    _print_chart(console, report, bar_width=bar_width)
    _print_sum_sq_shares(console, report, bar_width=bar_width)
    _print_findings(console, report.findings)
    _print_not_checked(console, report)
    _print_reference(console, report)
    _print_warnings(console, report.warnings)


def _print_verdict(console: Console, report: Report) -> None:
    severity = report.worst_severity
    style = _SEVERITY_STYLE[severity] if severity else "bold green"
    verdict = printable(report.verdict) if report.verdict else "no verdict"
    console.print(_line((f"{_SYMBOL[severity]} {verdict}", style)))
    console.print(
        _line(
            f"true global {norm_name(report.norm_type)} {fmt_float(report.global_norm)} · "
            f"expected clip coefficient {fmt_coef(report.expected_clip_coef)} · max_norm {fmt_float(report.max_norm)}"
        )
    )
    console.print(
        _line(
            f"step {report.step} · {len(report.ranks_present)}/{report.world_size} "
            f"{'rank' if report.world_size == 1 else 'ranks'} present · "
            f"{fmt_finding_counts(report.findings)}"
        )
    )


def _print_missing(console: Console, report: Report) -> None:
    if report.missing_ranks:
        console.print(
            _line(
                (f"missing ranks: {fmt_rank_set(report.missing_ranks, max_chars=200)}", "bold red"),
                " (the others were audited; checks that need them say so below)",
            )
        )


def _table(headers: Sequence[str], justify: str) -> Table:
    """A table whose columns are justified by the letters of `justify`: "l" left, "r" right."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for header, side in zip(headers, justify, strict=True):
        table.add_column(header, justify="right" if side == "r" else "left", overflow="fold")
    return table


def _print_ranks(console: Console, report: Report, *, fold: bool) -> None:
    folded = fold_ranks(report.ranks, max_groups=MAX_RANK_ROWS if fold else None)
    rank = "ranks" if folded.folded else "rank"
    table = _table([rank, "local norm", "reported norm", "applied coef", "diagnosis", "nonfinite"], "rrrrll")
    for group in folded.groups:
        local, reported, coef, _, nonfinite = group_cells(group)
        source = f" ({printable(group.applied_coef_source)})" if group.applied_coef_source else ""
        table.add_row(
            fmt_rank_set(group.ranks, max_chars=16),
            local,
            reported,
            _line(coef + source),
            _line(printable(diagnosis_label(group.diagnosis, group.ranks, report.findings))),
            _line((nonfinite, "bold red" if group.nonfinite.total else "")),
        )
    console.print(table)
    if folded.hidden_ranks:
        _print_aside(console, f"{fmt_hidden(folded)}; the JSON report lists every rank")
    _print_diagnosis_details(console, report)


def _print_diagnosis_details(console: Console, report: Report) -> None:
    groups = unsaid_diagnosis_groups(report.ranks, report.findings)
    for diagnosis, detail, ranks in groups[:MAX_DETAIL_LINES]:
        console.print(
            _line(
                f"  {fmt_ranks_labelled_short(ranks)}, {printable(diagnosis)}: ", (printable(detail), "dim")
            )
        )
    if len(groups) > MAX_DETAIL_LINES:
        _print_aside(console, f"{count(len(groups) - MAX_DETAIL_LINES, 'more explanation')} not shown")


def _print_chart(console: Console, report: Report, *, bar_width: int) -> None:
    """Each rank's part of the squared global norm as a bar, max_norm² marked: "each below, the sum above"."""
    console.print()
    chart = share_chart(report, limit=MAX_CHART_RANKS)
    if isinstance(chart, str):
        console.print(_line((f"no norm chart: {chart}", "dim")))
        return
    threshold = chart.threshold
    console.print(
        _line(
            ("Share of the squared global norm", "bold"),
            f" (total {fmt_float(chart.total)}) against max_norm² = {fmt_float(threshold)}, marked {THRESHOLD_MARK}",
        )
    )
    owners = {f"rank {rank}": owner for rank, owner in replica_owners(report.ranks).items()}
    scale = max([threshold] + [bar.value for bar in chart.bars if math.isfinite(bar.value)])
    label_width = max(len(bar.label) for bar in chart.bars)
    for bar in chart.bars:
        value = bar.value
        side = "above" if value > threshold else "below" if value <= threshold else ""
        numbers: list[Piece] = [
            f" {fmt_float(value):>8} {fmt_percent(bar.share):>6}  ",
            (side, "red" if side == "above" else ""),
        ]
        if bar.label in owners:
            numbers = [(f" {fmt_replica_of(owners[bar.label])}", "dim")]
        console.print(
            _line(f"  {bar.label:>{label_width}} ", *_bar(value, threshold, scale, bar_width), *numbers)
        )
    if chart.num_hidden:
        _print_aside(console, f"{count(chart.num_hidden, 'smaller rank')} not drawn")


MAX_NAME_CHARS = 40
"""A parameter's name in the shares of Σg² is cut to this many characters (the JSON report has it whole)."""


def _print_sum_sq_shares(console: Console, report: Report, *, bar_width: int) -> None:
    """Of a spike dump: the parameters holding most of Σg², as bars of their share (each rank's is above)."""
    shares = report.sum_sq_shares
    if shares is None:
        return
    console.print()
    console.print(_line((sumsq.TITLE, "bold"), f" ({sumsq.totals(shares)})"))
    said = (
        f"a spike: {printable(shares.note)}"
        if shares.note
        else "a spike of the true norm (the guard dumped this step)"
    )
    _print_aside(console, said)
    if not shares.top:
        console.print(_line(("  ", ""), (printable(shares.reason), "yellow")))
        return
    names = [printable(clip_text(s.param, MAX_NAME_CHARS)) for s in shares.top]
    name_width = max(len(name) for name in names)
    for name, share in zip(names, shares.top, strict=True):
        filled = min(bar_width, round(share.share * bar_width))
        console.print(
            _line(
                f"  {name:<{name_width}} ",
                ("█" * filled, "magenta"),
                " " * (bar_width - filled),
                f" {fmt_float(share.sum_sq):>8} {fmt_percent(share.share):>6}",
            )
        )
    _print_aside(console, sumsq.rest(shares))


def _bar(value: float, threshold: float, scale: float, width: int) -> list[Piece]:
    """The bar, split at the threshold mark: the part beyond it is what clipping should have removed."""
    filled = round(value / scale * width) if scale > 0 and math.isfinite(value) else 0
    mark = round(threshold / scale * width) if scale > 0 else 0
    below = "█" * min(filled, mark) + " " * max(0, mark - filled)
    above = "█" * max(0, filled - mark) + " " * (width - max(filled, mark))
    return [(below, "green"), THRESHOLD_MARK, (above, "red")]


def _print_findings(console: Console, findings: tuple[Finding, ...]) -> None:
    console.print()
    if not findings:
        console.print(_line(("Findings", "bold"), ": none"))
        return
    console.print(_line(("Findings", "bold"), f": {fmt_finding_counts(findings)}"))
    grid = _grid(2)
    for finding in findings:
        grid.add_row(
            _line("  ", (finding.severity.value, _SEVERITY_STYLE[finding.severity])),
            _line((printable(finding.code), "bold")),
            _finding_body(finding),
        )
    console.print(grid)


def _finding_body(finding: Finding) -> Text:
    lines: list[Sequence[Piece]] = [[(printable(finding.title), "bold")], [printable(finding.message)]]
    where = []
    if finding.ranks:
        where.append(fmt_ranks_labelled_short(finding.ranks))
    if finding.params:
        where.append("params " + join_limited(finding.params, limit=MAX_PARAMS_SHOWN, escape=printable))
    if where:
        lines.append([(" · ".join(where), "dim")])
    if finding.evidence:
        pairs = ", ".join(
            f"{printable(str(k))}={printable(fmt_value(v))}" for k, v in finding.evidence.items()
        )
        lines.append([(f"evidence: {pairs}", "dim")])
    if finding.fix:
        lines.append(
            [("fix: ", "bold"), finding.fix, (f" (more: gradaudit explain {printable(finding.code)})", "dim")]
        )
    return _lines(*lines)


def _grid(num_fixed: int) -> Table:
    """A borderless grid: `num_fixed` columns that never wrap, then one that does."""
    from rich.table import Table

    grid = Table.grid(padding=(0, 1))
    for _ in range(num_fixed):
        grid.add_column(no_wrap=True)
    grid.add_column()
    return grid


def _print_not_checked(console: Console, report: Report) -> None:
    if not report.not_checked:
        return
    console.print()
    console.print(_line(("Not checked", "bold")))
    grid = _grid(1)
    for item in report.not_checked:
        grid.add_row(
            _line(f"  {printable(item.code)}"),
            _line(f"{printable(item.title)}: ", (printable(item.reason), "dim")),
        )
    console.print(grid)


def _print_reference(console: Console, report: Report) -> None:
    if not report.reference:
        return
    ordered = reference_worst_first(report.reference)
    num_failing = sum(not c.within_tolerance for c in ordered)
    console.print()
    console.print(
        _line(
            ("Reference comparison", "bold"),
            f": {num_failing} of {len(ordered)} outside tolerance (worst first)",
        )
    )
    table = _table(["parameter", "tensor", "max abs error", "max rel error", "atol", "rtol", "ok"], "llrrrrl")
    for c in ordered[:MAX_REFERENCE_ROWS]:
        table.add_row(
            _line(printable(c.param)),
            _line(printable(c.kind)),
            fmt_float(c.max_abs_error),
            fmt_float(c.max_rel_error),
            fmt_float(c.atol),
            fmt_float(c.rtol),
            _line("yes") if c.within_tolerance else _line(("NO", "bold red")),
        )
    console.print(table)
    rest = ordered[MAX_REFERENCE_ROWS:]
    if rest:
        rest_failing = sum(not c.within_tolerance for c in rest)
        _print_aside(console, f"{len(rest)} more not shown ({rest_failing} outside tolerance)")


def _print_warnings(console: Console, warnings: tuple[str, ...]) -> None:
    if not warnings:
        return
    console.print()
    for warning in warnings[:MAX_WARNINGS]:
        console.print(_line(("warning:", "yellow"), f" {printable(warning)}"))
    if len(warnings) > MAX_WARNINGS:
        hidden = count(len(warnings) - MAX_WARNINGS, "more warning")
        _print_aside(console, f"{hidden} not shown; the JSON report lists them")


def _summary_table(rows: Sequence[StepRow]) -> Table:
    columns = ["step", "reported norm", "true norm", "ratio", "expected coef", "errors", "warnings", "codes"]
    table = _table(columns, "rrrrrrrl")
    for row in rows:
        table.add_row(
            _line((fmt_steps(row.steps), "" if row.failing else "dim")),
            fmt_span(row.reported_norm),
            fmt_span(row.global_norm),
            fmt_span(row.ratio),
            fmt_span(row.expected_clip_coef, fmt_coef),
            _line((str(row.num_errors), "bold red" if row.num_errors else "")),
            str(row.num_warnings),
            _line(printable(", ".join(row.codes)) or "-"),
        )
    return table


def _print_step_brief(console: Console, report: Report) -> None:
    _print_verdict(console, report)
    _print_missing(console, report)
    for finding in report.findings:
        ranks = f" ({fmt_ranks_labelled_short(finding.ranks)})" if finding.ranks else ""
        console.print(
            _line(
                "  ",
                (f"{finding.severity.value:<7}", _SEVERITY_STYLE[finding.severity]),
                f" {printable(finding.code)} {printable(finding.title)}",
                (ranks, "dim"),
                (f" · fix: gradaudit explain {printable(finding.code)}" if finding.fix else "", "dim"),
            )
        )
    if report.sum_sq_shares is not None:
        console.print(_line("  spike: ", (sumsq.sentence(report.sum_sq_shares, printable), "magenta")))
    for warning in report.warnings:
        console.print(_line("  ", ("warning:", "yellow"), f" {printable(warning)}"))
    if report.command:
        _print_aside(console, f"full report: {printable(report.command)}")
