"""Markdown rendering of an audit report: the body of a bug ticket, with every untrusted string escaped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..report import Finding, MultiStepReport, Report, Severity
from .numbers import (
    diagnosis_groups,
    fmt_coef,
    fmt_finding_counts,
    fmt_float,
    fmt_nonfinite,
    fmt_percent,
    fmt_ranks,
    fmt_ranks_labelled,
    fmt_ratio,
    fmt_value,
    norm_name,
    reference_worst_first,
)
from .text import join_limited, markdown_code_block, markdown_escape

MAX_PARAMS_SHOWN = 20
MAX_REFERENCE_ROWS = 20

_SYMBOL = {Severity.ERROR: "✗", Severity.WARNING: "⚠", Severity.INFO: "ℹ", None: "✓"}


def render_report(report: Report) -> str:
    blocks = [f"# gradaudit report: step {report.step}", *_report_blocks(report)]
    return "\n\n".join(block.rstrip("\n") for block in blocks) + "\n"


def render_multi(multi: MultiStepReport) -> str:
    blocks = [
        f"# gradaudit report: {len(multi.steps)} steps in {markdown_escape(multi.directory)}",
        _summary_table(multi),
    ]
    for report in multi.steps:
        blocks.append(f"## Step {report.step}")
        blocks.extend(_step_brief(report))
    blocks.append(f"<sub>gradaudit report version {multi.report_version}</sub>")
    return "\n\n".join(block.rstrip("\n") for block in blocks) + "\n"


def _report_blocks(report: Report) -> list[str]:
    blocks = [_verdict(report), _headline_table(report)]
    if report.missing_ranks:
        blocks.append(f"**Missing ranks:** {fmt_ranks(report.missing_ranks)} (the other ranks were audited).")
    blocks += ["## Environment", _environment_table(report)]
    blocks += ["## Ranks", _rank_table(report)]
    blocks.append("## Findings")
    blocks += [_finding_block(f) for f in report.findings] or ["None."]
    if report.not_checked:
        blocks += [
            "## Not checked",
            _bullets(
                f"**{markdown_escape(n.code)}** {markdown_escape(n.title)}: {markdown_escape(n.reason)}"
                for n in report.not_checked
            ),
        ]
    if report.reference:
        blocks += ["## Reference comparison", _reference_table(report)]
    if report.warnings:
        blocks += ["## Warnings", _bullets(markdown_escape(w) for w in report.warnings)]
    blocks += ["## Reproduce", _reproduce(report.command)]
    blocks.append(f"<sub>gradaudit report version {report.report_version}</sub>")
    return blocks


def _verdict(report: Report) -> str:
    verdict = markdown_escape(report.verdict) if report.verdict else "no verdict"
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


def _environment_table(report: Report) -> str:
    rows = [[markdown_escape(k), markdown_escape(v)] for k, v in sorted(report.environment.items())]
    rows += [
        [f"topology {markdown_escape(k)}", markdown_escape(v)] for k, v in sorted(report.topology.items())
    ]
    if not rows:
        return "Not recorded."
    return _table(["run", "value"], rows)


def _rank_table(report: Report) -> str:
    if not report.ranks:
        return "No rank could be read."
    header = [
        "rank",
        "local norm",
        "reported norm",
        "applied coef",
        "coef from",
        "diagnosis",
        "share of Σg²",
        "nonfinite",
    ]
    rows = [
        [
            str(row.rank),
            fmt_float(row.local_norm),
            fmt_float(row.reported_norm),
            fmt_coef(row.applied_clip_coef),
            markdown_escape(row.applied_coef_source) if row.applied_coef_source else "-",
            markdown_escape(row.diagnosis) if row.diagnosis else "-",
            fmt_percent(row.share_of_squared_norm),
            fmt_nonfinite(row.nonfinite),
        ]
        for row in report.ranks
    ]
    table = _table(header, rows, align=["r", "r", "r", "r", "l", "l", "r", "l"])
    details = _diagnosis_details(report)
    return f"{table}\n\n{details}" if details else table


def _diagnosis_details(report: Report) -> str:
    return _bullets(
        f"{fmt_ranks_labelled(ranks)}, {markdown_escape(diagnosis)}: {markdown_escape(detail)}"
        for diagnosis, detail, ranks in diagnosis_groups(report.ranks)
    )


def _finding_block(finding: Finding) -> str:
    lines = [
        f"### {_SYMBOL[finding.severity]} {finding.severity.value} {markdown_escape(finding.code)}: "
        f"{markdown_escape(finding.title)}",
        "",
        markdown_escape(finding.message),
    ]
    facts = []
    if finding.ranks:
        facts.append(fmt_ranks_labelled(finding.ranks))
    if finding.params:
        facts.append(
            "params: " + join_limited(finding.params, limit=MAX_PARAMS_SHOWN, escape=markdown_escape)
        )
    if finding.evidence:
        facts.append(
            "evidence: "
            + ", ".join(
                f"{markdown_escape(str(k))} = {_evidence_value(v)}" for k, v in finding.evidence.items()
            )
        )
    if facts:
        lines += ["", _bullets(facts)]
    return "\n".join(lines)


def _evidence_value(value: object) -> str:
    return markdown_escape(value) if isinstance(value, str) else fmt_value(value)


def _reference_table(report: Report) -> str:
    ordered = reference_worst_first(report.reference)
    failing = sum(not c.within_tolerance for c in ordered)
    rows = [
        [
            markdown_escape(c.param),
            markdown_escape(c.kind),
            fmt_float(c.max_abs_error),
            fmt_float(c.max_rel_error),
            fmt_float(c.atol),
            fmt_float(c.rtol),
            "yes" if c.within_tolerance else "**no**",
        ]
        for c in ordered[:MAX_REFERENCE_ROWS]
    ]
    intro = f"{failing} of {len(ordered)} outside tolerance, worst first."
    table = _table(
        ["parameter", "tensor", "max abs error", "max rel error", "atol", "rtol", "within tolerance"],
        rows,
        align=["l", "l", "r", "r", "r", "r", "l"],
    )
    hidden = len(ordered) - MAX_REFERENCE_ROWS
    outro = f"\n\n{hidden} more not shown." if hidden > 0 else ""
    return f"{intro}\n\n{table}{outro}"


def _reproduce(command: str) -> str:
    if not command:
        return "The command was not recorded."
    return markdown_code_block(command, info="sh")


def _summary_table(multi: MultiStepReport) -> str:
    header = ["step", "reported norm", "true norm", "ratio", "expected coef", "errors", "warnings", "codes"]
    rows = [
        [
            str(s.step),
            fmt_float(s.reported_norm),
            fmt_float(s.global_norm),
            fmt_ratio(s.reported_norm, s.global_norm),
            fmt_coef(s.expected_clip_coef),
            str(s.num_errors),
            str(s.num_warnings),
            markdown_escape(", ".join(s.codes)) or "-",
        ]
        for s in multi.summary
    ]
    return _table(header, rows, align=["r", "r", "r", "r", "r", "r", "r", "l"])


def _step_brief(report: Report) -> list[str]:
    blocks = [_verdict(report), _headline_table(report)]
    if report.missing_ranks:
        blocks.append(f"**Missing ranks:** {fmt_ranks(report.missing_ranks)}.")
    items = [
        f"**{f.severity.value} {markdown_escape(f.code)}** {markdown_escape(f.title)}"
        + (f" ({fmt_ranks_labelled(f.ranks)})" if f.ranks else "")
        + f": {markdown_escape(f.message)}"
        for f in report.findings
    ]
    items += [f"**warning:** {markdown_escape(w)}" for w in report.warnings]
    if items:
        blocks.append(_bullets(items))
    if report.command:
        blocks.append(_reproduce(report.command))
    return blocks


def _bullets(items: Iterable[str]) -> str:
    return "\n".join(f"- {item}" for item in items)


def _table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, align: Sequence[str] | None = None
) -> str:
    """A GitHub table; cells must already be escaped (no `|`, no newline)."""
    marks = {"l": "---", "r": "---:"}
    separator = [marks[a] for a in (align or ["l"] * len(header))]
    lines = [header, separator, *rows]
    return "\n".join("| " + " | ".join(cell if cell != "" else " " for cell in line) + " |" for line in lines)
