"""Markdown rendering of an audit report: the body of a bug ticket, with every untrusted string escaped."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..checks.base import count as _count
from ..norms import norm_name
from ..report.model import Finding, GuardTrend, MultiStepReport, Report, Severity, TrendStep
from ..report.param_shares import SumSqShares
from . import guardtrend, sumsq
from .charts import mermaid_share_chart, mermaid_trend_chart, share_chart, trend_points
from .fold import (
    fmt_groups,
    fmt_hidden,
    fmt_rank_set,
    fmt_ranks_labelled_short,
    fmt_span,
    fold_ranks,
    group_cells,
)
from .numbers import (
    diagnosis_label,
    fmt_coef,
    fmt_finding_counts,
    fmt_float,
    fmt_percent,
    fmt_replica_of,
    fmt_value,
    reference_worst_first,
    replica_owners,
    unsaid_diagnosis_groups,
)
from .steps import StepRow, first_call_notes, fmt_steps, is_failing, step_rows
from .text import (
    clip_sentences,
    clip_text,
    join_limited,
    markdown_code_block,
    markdown_escape,
    markdown_text_block,
)

MAX_CHARS = 20_000
"""A report must fit a ticket (GitHub refuses issue bodies over 65,536 characters) at any world size."""
MAX_PARAMS_SHOWN = 10
MAX_REFERENCE_ROWS = 20
MAX_RANK_GROUPS = 24
MAX_DETAIL_LINES = 8
MAX_NAME_CHARS = 120
"""Untrusted names and short texts are cut to this many characters before escaping."""
MAX_MESSAGE_CHARS = 600
FINDINGS_FULL_BUDGET = 6_000
"""Characters of findings shown in full; the rest are listed one line each, then counted."""
FINDINGS_BRIEF_BUDGET = 2_000
LIST_BUDGET = 1_500
"""Characters of a bullet list (not checked, warnings) before the rest is counted."""
OPEN_ROWS = 8
"""Tables with more rows than this go inside a <details> block."""
STEPS_BUDGET = 12_000
"""Characters of per-step sections in a multi-step report before the rest are counted."""
SEE_JSON = "see `gradaudit check --format json` for everything"

_SYMBOL = {Severity.ERROR: "✗", Severity.WARNING: "⚠", Severity.INFO: "ℹ", None: "✓"}


def render_report(report: Report, *, fold: bool = True) -> str:
    """The report as a ticket body: verdict and findings first, per-rank detail folded and in <details>.

    `fold=False` lists every rank on its own row (the size bound then no longer holds).
    """
    blocks = [f"# gradaudit report: step {report.step}", *_report_blocks(report, fold=fold)]
    return _join(_fit(blocks, MAX_CHARS if fold else None))


def render_multi(multi: MultiStepReport, *, failing_only: bool = False) -> str:
    """A folder of steps: a guarded run's trend first, then the summary (failing steps first, clean
    steps folded into runs, left out with `failing_only`), then each failing step."""
    failing = [report for report in multi.steps if is_failing(report)]
    counted = f"{_count(len(multi.steps), 'step')} ({len(failing)} failing)"
    trend = multi.guard_trend
    if trend is None:
        blocks = [f"# gradaudit report: {counted} in {_md(multi.directory)}"]
    else:
        blocks = _guarded_run_blocks(multi.directory, trend, dumped=bool(multi.steps))
        if not multi.steps:
            return _join([*blocks, _version_line(multi.report_version)])
        blocks.append(f"## Dumps: {counted}")
    rows, hidden = step_rows(multi, failing_only=failing_only)
    if rows:
        summary = "\n\n".join([_summary_table(rows), *(f"{note}." for note in first_call_notes(rows))])
        blocks.append(
            _details(f"Summary of the {len(multi.summary)} steps ({len(rows)} rows)", summary)
            if len(rows) > 3 * OPEN_ROWS
            else summary
        )
    trend_chart = _trend_section(multi)
    if trend_chart:
        blocks.append(trend_chart)
    sections = ["\n\n".join([f"## Step {report.step}", *_step_brief(report)]) for report in failing]
    shown, not_shown = _take_within(sections, STEPS_BUDGET)
    blocks += shown
    if not_shown:
        blocks.append(f"{_count(len(not_shown), 'more failing step')} not shown; {SEE_JSON}.")
    clean = [report.step for report in multi.steps if not is_failing(report)]
    if clean:
        blocks.append(
            f"No errors, warnings or missing ranks in {'step' if len(clean) == 1 else 'steps'} "
            f"{fmt_rank_set(clean, max_chars=200)}."
        )
    if hidden:
        blocks.append(f"{_count(len(hidden), 'clean step')} not listed (--failing-only).")
    blocks.append(_version_line(multi.report_version))
    return _join(blocks)


def _guarded_run_blocks(directory: str, trend: GuardTrend, *, dumped: bool) -> list[str]:
    """The title and the guard's trend: what it found during training, failing steps first, those it
    did not dump, then the norms of the last checked steps as a text chart."""
    steps = _count(trend.num_checked, "step")
    if trend.failing:
        found = f"{len(trend.failing)} with wrong clipping"
        skipped = f", {trend.num_skipped} skipped by the scaler" if trend.num_skipped else ""
        intro = f"**✗** The guard checked {steps} during training: {trend.num_clean} clean, {found}{skipped}"
    else:
        found = "none with wrong clipping" if trend.num_skipped else "all clean"
        intro = f"**✓** {guardtrend.all_clean(trend)}" + ("" if dumped else " The guard dumped nothing")
    blocks = [
        f"# gradaudit report: guarded run {_md(directory)}: {steps} checked, {found}",
        "## Guard trend",
        f"{intro} ({_md(trend.file)} has every step).",
    ]
    if trend.notes:
        blocks.append(_bullets(f"**warning:** {_md(note, MAX_MESSAGE_CHARS)}" for note in trend.notes))
    if trend.failing:
        blocks.append(_trend_steps(trend.failing, _codes_and_numbers, "dumped to", "more failing step"))
    if trend.not_dumped:
        blocks.append(f"**{_md(guardtrend.not_dumped(trend))}.**")
    if trend.spikes:
        where = "which parameters hold Σg²: gradaudit check"
        listed = _trend_steps(
            trend.spikes, lambda step: f": {guardtrend.spike_numbers(step)}", where, "more spike"
        )
        blocks += [f"**{guardtrend.spikes_counted(trend)}** (the guard's `spike=`):", listed]
    rows = guardtrend.chart_rows(trend, lambda text: text)
    if rows:
        blocks.append(f"{_capitalized(guardtrend.chart_title(trend))}\n\n{markdown_text_block(rows)}")
    if trend.full_captures:
        blocks.append(_bullets(guardtrend.full_capture(d, _md) for d in trend.full_captures))
    return blocks


def _trend_steps(steps: Sequence[TrendStep], said: Callable[[TrendStep], str], dumped: str, more: str) -> str:
    """The first of a guarded run's failing (or spiked) steps, each as `said` after its number and with
    its dump, then how many more."""
    items = [
        f"**step {step.step}**{said(step)}"
        + (" — **not dumped**" if step.dump is None else f" — {dumped} {_md(step.dump)}")
        for step in steps[: guardtrend.SHOWN_FAILING]
    ]
    hidden = len(steps) - len(items)
    if hidden:
        items.append(f"and {_count(hidden, more)}; {SEE_JSON}")
    return _bullets(items)


def _codes_and_numbers(step: TrendStep) -> str:
    return f" {', '.join(_md(code) for code in step.codes)}: {guardtrend.numbers(step)}"


def _join(blocks: Sequence[str]) -> str:
    return "\n\n".join(block.rstrip("\n") for block in blocks) + "\n"


def _md(text: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """Untrusted text for Markdown: cut, then escaped."""
    return markdown_escape(clip_text(text, max_chars))


def _capitalized(text: str) -> str:
    return text[0].upper() + text[1:]


def _version_line(version: int) -> str:
    return f"<sub>gradaudit report version {version}</sub>"


@dataclass(frozen=True)
class _Optional:
    """A block the report can do without when it would not fit (replaced by a line saying so)."""

    text: str
    what: str
    drop_order: int
    """Blocks with lower numbers are dropped first."""


def _fit(blocks: Sequence[str | _Optional], max_chars: int | None) -> list[str]:
    """Drop optional blocks, lowest `drop_order` first, until the report fits; each leaves one line."""
    texts = [block.text if isinstance(block, _Optional) else block for block in blocks]
    if max_chars is None:
        return texts
    optional = sorted(
        ((block.drop_order, i, block) for i, block in enumerate(blocks) if isinstance(block, _Optional)),
        key=lambda item: item[:2],
    )
    for _, i, block in optional:
        if len(_join(texts)) <= max_chars:
            break
        texts[i] = f"*{block.what} left out to keep this report short; {SEE_JSON}.*"
    return texts


def _report_blocks(report: Report, *, fold: bool) -> list[str | _Optional]:
    blocks: list[str | _Optional] = [_verdict(report), _headline_table(report)]
    if report.missing_ranks:
        blocks.append(
            f"**Missing ranks:** {fmt_rank_set(report.missing_ranks, max_chars=200)} (the other ranks were audited)."
        )
    blocks += ["## Findings", *_findings(report.findings)]
    if report.not_checked:
        items = [
            f"**{_md(n.code)}** {_md(n.title)}: {_md(n.reason, MAX_MESSAGE_CHARS)}"
            for n in report.not_checked
        ]
        blocks += [
            "## Not checked",
            _Optional(_bullets_within(items, LIST_BUDGET), "The list of checks not run", 4),
        ]
    blocks += ["## Ranks", _Optional(_rank_section(report, fold=fold), "The per-rank table", 5)]
    chart = _share_section(report)
    if chart:
        blocks.append(_Optional(chart, "The chart of each rank's share of the squared norm", 0))
    if report.sum_sq_shares is not None:
        blocks.append(_Optional(_sum_sq_section(report.sum_sq_shares), "The parameters' shares of Σg²", 2))
    if report.reference:
        blocks += [
            "## Reference comparison",
            _Optional(_reference_table(report), "The reference comparison", 2),
        ]
    if report.warnings:
        items = [_md(w, MAX_MESSAGE_CHARS) for w in report.warnings]
        blocks += ["## Warnings", _Optional(_bullets_within(items, LIST_BUDGET), "The warnings", 3)]
    blocks += ["## Environment", _Optional(_environment_section(report), "The environment", 1)]
    blocks += ["## Reproduce", _Optional(_reproduce(report.command), "The command", 6)]
    blocks.append(_version_line(report.report_version))
    return blocks


def _verdict(report: Report) -> str:
    verdict = _md(report.verdict, 1_000) if report.verdict else "no verdict"
    return f"**{_SYMBOL[report.worst_severity]} Verdict:** {verdict}"


def _headline_table(report: Report) -> str:
    return _table(
        [
            f"true global {norm_name(report.norm_type)}",
            "expected clip coef",
            "max_norm",
            "ranks present",
            "findings",
        ],
        [
            [
                fmt_float(report.global_norm),
                fmt_coef(report.expected_clip_coef),
                fmt_float(report.max_norm),
                f"{len(report.ranks_present)} of {report.world_size}",
                fmt_finding_counts(report.findings),
            ]
        ],
    )


def _findings(findings: Sequence[Finding]) -> list[str]:
    if not findings:
        return ["None."]
    full, rest = _take_within([_finding_block(f) for f in findings], FINDINGS_FULL_BUDGET)
    blocks = list(full)
    if rest:
        brief, hidden = _take_within([_finding_line(f) for f in findings[len(full) :]], FINDINGS_BRIEF_BUDGET)
        summary = _count(len(rest), "more finding")
        body = "\n".join(f"- {line}" for line in brief)
        if hidden:
            body += f"\n\n{len(hidden)} more not listed; {SEE_JSON}."
        blocks.append(_details(summary, body))
    return blocks


def _finding_line(finding: Finding) -> str:
    ranks = f" ({fmt_ranks_labelled_short(finding.ranks)})" if finding.ranks else ""
    return f"**{finding.severity.value} {_md(finding.code)}** {_md(finding.title)}{ranks}"


def _take_within(items: Sequence[str], budget: int) -> tuple[list[str], list[str]]:
    """The leading items whose total length stays within `budget` (at least one), and the rest."""
    taken: list[str] = []
    used = 0
    for item in items:
        if taken and used + len(item) > budget:
            break
        taken.append(item)
        used += len(item) + 2
    return taken, list(items[len(taken) :])


def _bullets_within(items: Sequence[str], budget: int) -> str:
    shown, hidden = _take_within(items, budget)
    text = _bullets(shown)
    return f"{text}\n- and {len(hidden)} more; {SEE_JSON}" if hidden else text


def _details(summary: str, body: str) -> str:
    return f"<details><summary>{summary}</summary>\n\n{body}\n\n</details>"


def _environment_section(report: Report) -> str:
    env, topo = report.environment, report.topology
    rows = [
        ["gradaudit (auditor)", _md(env.auditor_version) or "-"],
        ["gradaudit (dump)", _names(env.dump_versions)],
        ["torch (dump)", _names(env.torch_versions)],
        ["world size", "-" if env.world_size is None else str(env.world_size)],
        ["hosts", _names(env.hosts)],
        ["capture mode", _names(env.modes)],
        ["run id", _names(env.run_ids)],
    ]
    if topo.mesh is not None:
        mesh = " × ".join(
            f"{_md(n)}={s}" for n, s in zip(topo.mesh.axis_names, topo.mesh.shape, strict=False)
        )
        rows.append(["device mesh", mesh])
    rows += [[f"group {_md(name)}", fmt_groups(lists)] for name, lists in list(topo.groups.items())[:16]]
    if len(topo.groups) > 16:
        rows.append(["groups", f"{len(topo.groups) - 16} more not shown"])
    if topo.norm_group is not None:
        rows.append(["norm reduced over", _md(topo.norm_group)])
    counted = [_count(len(env.hosts), "host"), _count(len(topo.groups), "process group")]
    summary = ", ".join(counted if env.world_size is None else [f"world size {env.world_size}", *counted])
    return _details(f"Versions, hosts and process groups ({summary})", _table(["", "value"], rows))


def _names(values: Sequence[str], limit: int = 8) -> str:
    return join_limited(list(values), limit=limit, escape=lambda v: _md(v, 60)) if values else "-"


def _rank_section(report: Report, *, fold: bool) -> str:
    if not report.ranks:
        return "No rank could be read."
    folded = fold_ranks(report.ranks, max_groups=MAX_RANK_GROUPS if fold else None)
    header = [
        "ranks",
        "local norm",
        "reported norm",
        "applied coef",
        "coef from",
        "diagnosis",
        "share of Σg²",
        "nonfinite",
    ]
    rows = []
    owners = replica_owners(report.ranks)
    for group in folded.groups:
        local, reported, coef, share, nonfinite = group_cells(group)
        if all(rank in owners for rank in group.ranks):
            share = fmt_replica_of(owners[group.ranks[0]] if len(group.ranks) == 1 else None)
        rows.append(
            [
                fmt_rank_set(group.ranks),
                local,
                reported,
                coef,
                _md(group.applied_coef_source) if group.applied_coef_source else "-",
                _md(diagnosis_label(group.diagnosis, group.ranks, report.findings))
                if group.diagnosis
                else "-",
                share,
                nonfinite,
            ]
        )
    table = _table(header, rows, "lrrrllrl", "Per-rank table")
    parts = []
    if folded.folded:
        parts.append(
            f"{_count(len(report.ranks), 'rank')} in {_count(len(rows), 'row')}: ranks that agree share a row, "
            "numbers that differ within a row are shown as ranges."
        )
    parts.append(table)
    if folded.hidden_ranks:
        parts.append(f"{fmt_hidden(folded)}; {SEE_JSON}.")
    details = _diagnosis_details(report)
    if details:
        parts.append(details)
    return "\n\n".join(parts)


def _share_section(report: Report) -> str:
    """Each rank's part of Σg² against max_norm²: a chart GitHub draws, and the same numbers as a table."""
    chart = share_chart(report)
    if isinstance(chart, str):
        return ""
    drawn = mermaid_share_chart(chart)
    owners = {f"rank {rank}": owner for rank, owner in replica_owners(report.ranks).items()}
    rows = [
        [
            bar.label,
            fmt_float(bar.value),
            fmt_replica_of(owners[bar.label]) if bar.label in owners else fmt_percent(bar.share),
            "**above**" if bar.value > chart.threshold else "below",
        ]
        for bar in chart.bars
    ]
    table = _table(["", "part of Σg²", "share", "against max_norm²"], rows, "lrrl", "The same numbers")
    parts = [
        f"### Share of the squared global norm\n\nTotal {fmt_float(chart.total)} against max_norm² = "
        f"{fmt_float(chart.threshold)}: each rank's part and the sum (a clip by local norms compares each "
        "part with max_norm², the intended rule the sum)."
    ]
    if drawn:
        parts.append(drawn)
    parts.append(table)
    if chart.num_hidden:
        parts.append(f"{_count(chart.num_hidden, 'smaller rank')} not drawn.")
    return "\n\n".join(parts)


def _sum_sq_section(shares: SumSqShares) -> str:
    """Of a spike dump: the parameters holding most of Σg², as a table (each rank's share is above)."""
    why = sumsq.why(shares, lambda note: _md(note, MAX_MESSAGE_CHARS))
    parts = [f"### {sumsq.TITLE}", f"{_capitalized(why)}; {sumsq.totals(shares)}."]
    if not shares.top:
        return "\n\n".join([*parts, f"{_md(shares.reason, MAX_MESSAGE_CHARS)}."])
    rows = [[_md(s.param), fmt_float(s.sum_sq), fmt_percent(s.share)] for s in shares.top]
    parts.append(_table(["parameter", "Σg²", "share"], rows, "lrr"))
    if rest := sumsq.rest(shares):
        parts.append(f"{_capitalized(rest)}.")
    return "\n\n".join(parts)


def _trend_section(multi: MultiStepReport) -> str:
    """The true and reported norm per step as a chart GitHub draws (the summary table has the numbers)."""
    failing = {report.step for report in multi.steps if is_failing(report)}
    points = trend_points(multi, failing)
    max_norms = {report.max_norm for report in multi.steps if report.max_norm is not None}
    drawn = mermaid_trend_chart(points, next(iter(max_norms)) if len(max_norms) == 1 else None)
    if not drawn:
        return ""
    shown = "" if len(points) == len(multi.summary) else f" ({len(points)} of the {len(multi.summary)} steps)"
    several = [p.step for p in points if p.clip_calls > 1]
    first = (
        f" Step{'s' if len(several) > 1 else ''} {fmt_rank_set(several, max_chars=200)}, clipped more "
        "than once: the true and reported norm at the first clip call, as in the table."
        if several
        else ""
    )
    return (
        f"## Trend\n\nTrue and reported norm per step{shown}; the summary table above has the numbers.{first}"
        f"\n\n{drawn}"
    )


def _diagnosis_details(report: Report) -> str:
    groups = unsaid_diagnosis_groups(report.ranks, report.findings)
    lines = [
        f"{fmt_ranks_labelled_short(ranks)}, {_md(diagnosis)}: {_md(detail, 300)}"
        for diagnosis, detail, ranks in groups[:MAX_DETAIL_LINES]
    ]
    if len(groups) > MAX_DETAIL_LINES:
        lines.append(f"{_count(len(groups) - MAX_DETAIL_LINES, 'more explanation')} not shown")
    return _bullets(lines)


def _finding_block(finding: Finding) -> str:
    lines = [
        f"### {_SYMBOL[finding.severity]} {finding.severity.value} {_md(finding.code)}: {_md(finding.title)}",
        "",
        _message(finding.message),
    ]
    facts = []
    if finding.ranks:
        facts.append(fmt_ranks_labelled_short(finding.ranks))
    if finding.params:
        facts.append("params: " + join_limited(finding.params, limit=MAX_PARAMS_SHOWN, escape=_md))
    if finding.evidence:
        pairs = [f"{_md(str(k))} = {_evidence_value(v)}" for k, v in list(finding.evidence.items())[:16]]
        more = len(finding.evidence) - len(pairs)
        facts.append("evidence: " + ", ".join(pairs) + (f" (+{more} more)" if more > 0 else ""))
    if finding.fix:
        facts.append(f"**fix:** {_md(finding.fix, 2_000)} (more: `gradaudit explain {_md(finding.code)}`)")
    if facts:
        lines += ["", _bullets(facts)]
    return "\n".join(lines)


def _message(message: str) -> str:
    """A finding's message, cut between clauses when long (the JSON report has all of it)."""
    return markdown_escape(
        clip_sentences(message, MAX_MESSAGE_CHARS, rest="… (the JSON report has the rest)")
    )


def _evidence_value(value: object) -> str:
    return _md(value) if isinstance(value, str) else fmt_value(value)


def _reference_table(report: Report) -> str:
    ordered = reference_worst_first(report.reference)
    failing = sum(not c.within_tolerance for c in ordered)
    rows = [
        [
            _md(c.param),
            _md(c.kind),
            fmt_float(c.max_abs_error),
            fmt_float(c.max_rel_error),
            fmt_float(c.atol),
            fmt_float(c.rtol),
            "yes" if c.within_tolerance else "**no**",
        ]
        for c in ordered[:MAX_REFERENCE_ROWS]
    ]
    intro = f"{failing} of {len(ordered)} outside tolerance, worst first."
    header = ["parameter", "tensor", "max abs error", "max rel error", "atol", "rtol", "within tolerance"]
    table = _table(header, rows, "llrrrrl", "Reference table")
    hidden = len(ordered) - MAX_REFERENCE_ROWS
    outro = f"\n\n{hidden} more not shown." if hidden > 0 else ""
    return f"{intro}\n\n{table}{outro}"


def _reproduce(command: str) -> str:
    if not command:
        return "The command was not recorded."
    return markdown_code_block(clip_text(command, 2_000), info="sh")


def _summary_table(rows: Sequence[StepRow]) -> str:
    header = ["step", "reported norm", "true norm", "ratio", "expected coef", "errors", "warnings", "codes"]
    cells = [
        [
            fmt_steps(row.steps),
            fmt_span(row.reported_norm),
            fmt_span(row.global_norm),
            fmt_span(row.ratio),
            fmt_span(row.expected_clip_coef, fmt_coef),
            f"**{row.num_errors}**" if row.num_errors else "0",
            str(row.num_warnings),
            _md(", ".join(row.codes), 200) or "-",
        ]
        for row in rows
    ]
    return _table(header, cells, "rrrrrrrl")


def _step_brief(report: Report) -> list[str]:
    blocks = [_verdict(report), _headline_table(report)]
    if report.missing_ranks:
        blocks.append(f"**Missing ranks:** {fmt_rank_set(report.missing_ranks, max_chars=200)}.")
    items = [
        f"{_finding_line(f)}: {_message(f.message)}"
        + (f" (fix: `gradaudit explain {_md(f.code)}`)" if f.fix else "")
        for f in report.findings
    ]
    if report.sum_sq_shares is not None:
        items.append(f"**spike:** {sumsq.sentence(report.sum_sq_shares, _md)}")
    items += [f"**warning:** {_md(w, MAX_MESSAGE_CHARS)}" for w in report.warnings]
    if items:
        blocks.append(_bullets_within(items, FINDINGS_BRIEF_BUDGET))
    if report.command:
        blocks.append(_reproduce(report.command))
    return blocks


def _bullets(items: Iterable[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str = "", details: str = "") -> str:
    """A GitHub table, each column aligned by its letter of `align` ("l" or "r"; default all "l"); cells
    must already be escaped (no `|`, no newline). With `details`, a table of more than OPEN_ROWS rows
    goes inside a <details> block of that summary."""
    separator = ["---:" if a == "r" else "---" for a in (align or "l" * len(header))]
    lines = [header, separator, *rows]
    table = "\n".join("| " + " | ".join(cell or " " for cell in line) + " |" for line in lines)
    return _details(f"{details} ({len(rows)} rows)", table) if details and len(rows) > OPEN_ROWS else table
