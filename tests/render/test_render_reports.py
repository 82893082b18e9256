"""Renderers of audit reports: golden files, hostile names, nonfinite numbers, determinism."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from goldens import RENDERER_GOLDENS, assert_golden

from gradaudit.render import json as json_render
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.report.model import REPORT_VERSION, NonfiniteCounts
from render.reports import (
    HOSTILE_NAMES,
    clean_report,
    hostile_report,
    missing_rank_report,
    multi_clipped_twice_report,
    multi_report,
    nonfinite_report,
    seed_report,
)

# ---------------------------------------------------------------- golden files

RENDERERS = {
    "terminal.txt": (terminal_render.render_report, terminal_render.render_multi),
    "md": (markdown_render.render_report, markdown_render.render_multi),
    "json": (json_render.render_report, json_render.render_multi),
}
SINGLE_SCENARIOS = {"seed": seed_report, "nonfinite": nonfinite_report, "hostile": hostile_report}


@pytest.mark.parametrize("suffix", sorted(RENDERERS))
@pytest.mark.parametrize("scenario", sorted(SINGLE_SCENARIOS))
def test_single_step_rendering_matches_its_golden_file(request, scenario, suffix):
    render_report, _ = RENDERERS[suffix]
    assert_golden(
        request, RENDERER_GOLDENS / f"{scenario}.{suffix}", render_report(SINGLE_SCENARIOS[scenario]())
    )


MULTI_SCENARIOS = {"multi": multi_report, "multi_clipped_twice": multi_clipped_twice_report}


@pytest.mark.parametrize("suffix", sorted(RENDERERS))
@pytest.mark.parametrize("scenario", sorted(MULTI_SCENARIOS))
def test_multi_step_rendering_matches_its_golden_file(request, scenario, suffix):
    _, render_multi = RENDERERS[suffix]
    assert_golden(
        request, RENDERER_GOLDENS / f"{scenario}.{suffix}", render_multi(MULTI_SCENARIOS[scenario]())
    )


def test_a_step_clipped_twice_shows_its_first_calls_norms_in_the_table_the_chart_and_the_json_summary():
    from gradaudit.render.charts import trend_points
    from gradaudit.render.steps import step_rows

    multi = multi_clipped_twice_report()
    (row,) = [row for row in step_rows(multi)[0] if row.steps == (2,)]
    (point,) = [p for p in trend_points(multi, {2}) if p.step == 2]
    (summary,) = [s for s in json.loads(json_render.render_multi(multi))["summary"] if s["step"] == 2]
    assert row.global_norm == (71.0, 71.0) and point.true_norm == 71.0 and summary["global_norm"] == 71.0
    # the first call's reported norm beside the first call's true norm: a ratio of 1, not 0.9 / 71
    assert (
        row.reported_norm == (71.0, 71.0) and point.reported_norm == 71.0 and summary["reported_norm"] == 71.0
    )
    assert row.ratio == (1.0, 1.0)
    coef = 1.0 / (71.0 + 1e-6)
    assert row.expected_clip_coef == (coef, coef) and summary["expected_clip_coef"] == coef
    assert row.clip_calls == 2 and point.clip_calls == 2 and "GA501" in summary["codes"]
    assert multi.steps[1].global_norm == 0.9  # the step's own report: before the last call
    note = "step 2: reported norm, true norm and expected coef at the first of its 2 clip calls"
    assert note in terminal_render.render_multi(multi, width=200)
    markdown = markdown_render.render_multi(multi)
    assert (
        note in markdown
        and "Step 2, clipped more than once: the true and reported norm at the first" in markdown
    )
    assert "line [0.5, 71, 0.5]\n    line [0.5, 71, 0.5]" in markdown  # the chart's true and reported lines


# ---------------------------------------------------------------- what the seed report must say


def test_terminal_report_starts_with_the_verdict_and_the_true_norm_and_coefficient():
    lines = terminal_render.render_report(seed_report()).splitlines()
    assert lines[0].startswith("✗ clipping used each rank's local norm 0.8")
    assert "true global L2 norm 1.6 · expected clip coefficient 0.625" in "\n".join(lines[:4])


def test_terminal_chart_puts_every_shard_below_the_threshold_mark_and_the_sum_above_it():
    text = terminal_render.render_report(seed_report())
    rank_rows = [line for line in text.splitlines() if line.strip().startswith("rank ") and "█" in line]
    total_row = next(line for line in text.splitlines() if line.strip().startswith("all ranks"))
    assert len(rank_rows) == 4
    for row in rank_rows:
        before, after = row.split(terminal_render.THRESHOLD_MARK)
        assert "█" in before and "█" not in after and row.endswith("below")
    before, after = total_row.split(terminal_render.THRESHOLD_MARK)
    assert "█" in after and total_row.endswith("above")


def test_terminal_chart_of_a_clean_step_keeps_every_bar_and_the_total_below_the_threshold():
    text = terminal_render.render_report(clean_report(step=1))
    bars = [line for line in text.splitlines() if terminal_render.THRESHOLD_MARK in line and "█" in line]
    assert len(bars) == 5 and all(line.endswith("below") for line in bars)
    assert all("█" not in line.split(terminal_render.THRESHOLD_MARK)[1] for line in bars)


def test_terminal_chart_draws_only_the_largest_ranks_of_a_big_world():
    base = seed_report()
    shares = [0.5] + [0.5 / 19] * 19
    ranks = tuple(
        replace(base.ranks[0], rank=r, share_of_squared_norm=share) for r, share in enumerate(shares)
    )
    report = replace(base, world_size=20, ranks_present=tuple(range(20)), ranks=ranks)
    text = terminal_render.render_report(report)
    drawn = [
        line.split()[1] for line in text.splitlines() if line.strip().startswith("rank ") and "█" in line
    ]
    assert len(drawn) == terminal_render.MAX_CHART_RANKS and drawn[0] == "0"
    assert drawn == sorted(drawn, key=int)
    assert f"{20 - terminal_render.MAX_CHART_RANKS} smaller ranks not drawn" in text


def test_terminal_rank_table_of_a_big_world_folds_ranks_into_ranges_and_lists_the_outliers():
    base = seed_report()
    row = base.ranks[0]
    ranks = [replace(row, rank=r, local_norm=0.1 + r / 10000) for r in range(1024)]
    ranks[700] = replace(ranks[700], nonfinite=NonfiniteCounts(nan=5))
    ranks[900] = replace(ranks[900], diagnosis="replicas_double_counted", diagnosis_detail="counted twice")
    report = replace(base, world_size=1024, ranks_present=tuple(range(1024)), ranks=tuple(ranks))
    text = terminal_render.render_report(report)
    lines = text.splitlines()
    assert re.search(
        r"^\s+0-699, 701-899, …\s+0\.1–0\.2023\s+0\.8\s+1 \(gradients\)\s+local_only\s+0$", text, re.M
    )
    assert "(1022 ranks)" in text
    assert re.search(r"^\s+700\s+0\.17\s+0\.8\s.*5 nan$", text, re.M)
    assert re.search(r"^\s+900\s+0\.19\s+0\.8\s.*replicas_double_co", text, re.M)
    assert any(line.startswith("  rank 900, replicas_double_counted: counted twice") for line in lines)


def test_terminal_rank_table_lists_every_rank_when_asked_not_to_fold():
    report = seed_report()
    folded = terminal_render.render_report(report)
    every = terminal_render.render_report(report, fold=False)
    assert re.search(r"^\s+0-3\s+0\.8", folded, re.MULTILINE)
    assert [int(m) for m in re.findall(r"^\s+(\d)\s+0\.8\s", every, re.MULTILINE)] == [0, 1, 2, 3]


def test_reference_comparison_lists_the_worst_parameter_first():
    report = seed_report()
    for text in (terminal_render.render_report(report), markdown_render.render_report(report)):
        assert text.index("grad_clipped" if "grad_clipped" in text else "grad\\_clipped") < text.index(
            "1e-07"
        )


def test_markdown_report_is_a_complete_bug_ticket_body_that_leads_with_the_verdict_and_findings():
    markdown = markdown_render.render_report(seed_report())
    order = [
        "# gradaudit report: step 1200",
        "**✗ Verdict:** clipping used each rank's local norm",
        "## Findings",
        "### ✗ error GA201: clipping used a local norm",
        "evidence: reported\\_norm = 0.8, true\\_norm = 1.6",
        "## Not checked",
        "## Ranks",
        "| 0-3 | 0.8 | 0.8 | 1 | gradients | local\\_only | 25.0% | 0 |",
        "## Reference comparison",
        "## Warnings",
        "## Environment",
        "<details><summary>Versions, hosts and process groups (world size 4, 2 hosts, 1 process group)</summary>",
        "| torch (dump) | 2.13.0 |",
        "| group dp\\_shard | 1 group of 4 ranks: {0-3} |",
        "</details>",
        "## Reproduce",
        "```sh\ngradaudit check ./run/step_1200 --reference ./ref/step_1200\n```",
    ]
    positions = [markdown.index(part) for part in order]
    assert positions == sorted(positions)


def test_missing_ranks_are_called_out_in_every_human_format():
    report = missing_rank_report(step=1300)
    assert "missing ranks: 3" in terminal_render.render_report(report)
    assert "**Missing ranks:** 3" in markdown_render.render_report(report)
    assert json.loads(json_render.render_report(report))["missing_ranks"] == [[3, 3]]


def test_json_report_has_the_stable_keys_and_severity_strings():
    data = json.loads(json_render.render_report(seed_report()))
    assert {
        "report_version",
        "step",
        "world_size",
        "ranks_present",
        "missing_ranks",
        "norm_type",
        "max_norm",
        "global_norm",
        "expected_clip_coef",
        "verdict",
        "ranks",
        "findings",
        "not_checked",
        "reference",
        "environment",
        "topology",
        "command",
        "warnings",
    } <= set(data)
    assert set(data["ranks"][0]) == {
        "rank",
        "local_norm",
        "reported_norm",
        "applied_clip_coef",
        "applied_coef_source",
        "diagnosis",
        "diagnosis_detail",
        "share_of_squared_norm",
        "nonfinite",
    }
    assert data["ranks"][0]["nonfinite"] == {"nan": 0, "posinf": 0, "neginf": 0}
    assert [f["severity"] for f in data["findings"]] == ["error", "error", "info"]
    assert set(data["findings"][0]) == {"code", "severity", "title", "message", "ranks", "params", "evidence"}
    assert data["global_norm"] == 1.6 and data["expected_clip_coef"] == 0.625


def test_multi_step_json_holds_the_summary_and_every_complete_step():
    data = json.loads(json_render.render_multi(multi_report()))
    assert [s["step"] for s in data["summary"]] == [1100, 1200, 1300]
    assert data["steps"][1] == json_render.report_to_dict(seed_report())
    assert data["directory"] == "./run" and data["report_version"] == REPORT_VERSION == 3


# ---------------------------------------------------------------- nonfinite numbers


def test_nonfinite_numbers_render_as_valid_json_strings():
    report = nonfinite_report()
    text = json_render.render_report(report)
    data = json.loads(text)
    json.dumps(json_render.report_to_dict(report), allow_nan=False)
    assert data["global_norm"] == "nan" and data["norm_type"] == "inf" and data["expected_clip_coef"] == "nan"
    assert data["ranks"][1]["local_norm"] == "inf" and data["ranks"][1]["share_of_squared_norm"] == "nan"
    evidence = data["findings"][0]["evidence"]
    assert evidence["max_abs"] == "inf" and evidence["min"] == "-inf" and evidence["global_norm"] == "nan"
    assert evidence["nan"] == 3
    assert not re.search(r"\b(NaN|Infinity)\b", text)


def test_nonfinite_numbers_are_spelled_out_in_terminal_and_markdown():
    report = nonfinite_report()
    terminal = terminal_render.render_report(report)
    assert "true global Linf norm nan" in terminal and "3 nan, 1 +inf" in terminal
    assert "no norm chart" in terminal
    markdown = markdown_render.render_report(report)
    assert "| 1 | inf | nan | - | - | - | nan | 3 nan, 1 +inf |" in markdown
    assert "max\\_abs = inf, global\\_norm = nan, min = -inf" in markdown


# ---------------------------------------------------------------- hostile names


def test_terminal_output_shows_hostile_names_literally_and_never_emits_escapes():
    text = terminal_render.render_report(hostile_report(), width=200)
    assert "\x1b" not in text and "\u202e" not in text
    text.encode("utf-8")
    assert "[red]0[/red]" in text
    assert "\\x1b[31mansi\\x1b[0m" in text and "line\\nbreak" in text and "\\u202eevil" in text
    assert ":thumbs_up:" in text and "权重.é.λ" in text
    assert "warning: back\\\\slash\\\\\n" in text


def test_terminal_output_ignores_force_color_in_the_environment(monkeypatch):
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    assert "\x1b" not in terminal_render.render_report(seed_report())
    assert "\x1b" not in terminal_render.render_multi(multi_report())


def test_colour_changes_only_the_styling_not_the_text():
    coloured = terminal_render.render_report(hostile_report(), color=True)
    assert "\x1b[" in coloured
    plain = re.sub(r"\x1b\[[0-9;]*m", "", coloured)
    plain_lines = [line.rstrip() for line in plain.splitlines()]
    assert plain_lines == terminal_render.render_report(hostile_report()).splitlines()


def _unescaped_pipes(line: str) -> int:
    count, escaped = 0, False
    for ch in line:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "|":
            count += 1
    return count


def _outside_code_blocks(markdown: str) -> list[str]:
    lines, fence = [], None
    for line in markdown.splitlines():
        if fence is None and line.startswith("```"):
            fence = line[: len(line) - len(line.lstrip("`"))]
        elif fence is not None and line == fence:
            fence = None
        elif fence is None:
            lines.append(line)
    assert fence is None, "a code block was left open"
    return lines


def test_markdown_tables_keep_their_cell_count_with_hostile_names():
    markdown = markdown_render.render_report(hostile_report())
    tables: list[list[str]] = [[]]
    for line in _outside_code_blocks(markdown):
        if line.startswith("|"):
            tables[-1].append(line)
        elif tables[-1]:
            tables.append([])
    tables = [t for t in tables if t]
    assert len(tables) >= 4
    for table in tables:
        assert len({_unescaped_pipes(line) for line in table}) == 1, table
    reference = next(t for t in tables if "max abs error" in t[0])
    assert len(reference) == 2 + len(HOSTILE_NAMES)


def test_markdown_escapes_markup_html_and_code_outside_the_reproduce_block():
    markdown = markdown_render.render_report(hostile_report())
    prose = "\n".join(_outside_code_blocks(markdown))
    assert "\x1b" not in markdown and "\u202e" not in markdown
    markdown.encode("utf-8")
    for char in "`<[":
        assert not re.search(
            r"(?<!\\)(?:\\\\)*" + re.escape(char), re.sub("</?(sub|details|summary)>", "", prose)
        ), char
    for token in ("*bold*", "_it_", "~~s~~", "$x$", "&amp;", "|b|", "# heading", "\\slash\\"):
        assert not re.search(r"(?<!\\)" + re.escape(token), prose), token
    assert "<script>" not in prose and "\\<script\\>" in prose
    assert "line\\\\nbreak" in prose
    assert "权重.é.λ" in prose
    assert not any(
        line.startswith(("- 1", "# heading", "#")) and "heading" in line for line in prose.splitlines()
    )
    block = markdown.split("## Reproduce\n\n", 1)[1]
    assert block.startswith("````sh\ngradaudit check './step_7/```\\n[red]|x'\n````\n")


def test_multi_step_renderers_escape_a_hostile_folder_name():
    directory = "./runs/[red]x\x1b[31m|`y`\nz"
    multi = replace(multi_report(), directory=directory)
    terminal = terminal_render.render_multi(multi)
    assert "\x1b" not in terminal and "[red]x\\x1b[31m|`y`\\nz" in terminal
    markdown = markdown_render.render_multi(multi)
    assert (
        markdown.splitlines()[0]
        == "# gradaudit report: 3 steps (2 failing) in ./runs/\\[red\\]x\\\\x1b\\[31m\\|\\`y\\`\\\\nz"
    )
    assert json.loads(json_render.render_multi(multi))["directory"] == directory


def test_json_round_trips_hostile_names_intact():
    report = hostile_report()
    data = json.loads(json_render.render_report(report))
    assert data["findings"][0]["params"] == list(HOSTILE_NAMES)
    assert data["warnings"] == list(HOSTILE_NAMES)
    assert [c["param"] for c in data["reference"]] == list(HOSTILE_NAMES)
    assert data["findings"][0]["evidence"][HOSTILE_NAMES[0]] == 1.5
    assert data["command"] == report.command
    assert data["environment"]["hosts"] == list(HOSTILE_NAMES)
    assert data["topology"]["groups"][HOSTILE_NAMES[0]] == [[0, 1], [2, 3]]
    assert data["ranks"][0]["diagnosis"] == f"wrong_group:{HOSTILE_NAMES[1]}"


# ---------------------------------------------------------------- determinism


@pytest.mark.parametrize("suffix", sorted(RENDERERS))
def test_rendering_the_same_report_twice_gives_identical_strings(suffix):
    render_report, render_multi = RENDERERS[suffix]
    for make in (seed_report, nonfinite_report, hostile_report):
        assert render_report(make()) == render_report(make())
    assert render_multi(multi_report()) == render_multi(multi_report())
