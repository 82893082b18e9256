"""Reports that say what to do: a fix line per error and warning, each explanation said once,
nothing cut mid-sentence, a step left unaffected said so, and `gradaudit --version`."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from builders import check, clip, finding, flat, sharded_rows, tensor_with_norm, write_step
from markdown_it import MarkdownIt

from gradaudit.checks.fixes import fix_for
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.render.text import clip_sentences
from gradaudit.report.sentences import fold_sentences
from gradaudit.version import __version__

REPO = Path(__file__).resolve().parents[2]


def _words(text: str) -> str:
    return " ".join(text.split())


def _local_clip(
    directory: Path, *, num_ranks: int = 4, shard_norm: float = 0.8, max_norm: float = 1.0
) -> Path:
    grads = [
        tensor_with_norm(shard_norm * (1 + r / 10), (2, 3), seed=r, dtype=torch.float64)
        for r in range(num_ranks)
    ]
    clips = {r: clip(max_norm, reported_norm=float(g.norm()), clip_coef=1.0) for r, g in enumerate(grads)}
    return sharded_rows(directory, grads, clips=clips)


def test_every_error_and_warning_ends_with_its_fix_and_the_explain_command():
    report = check(REPO / "sample_dumps" / "fsdp2_local_clip" / "step_1")
    terminal = _words(terminal_render.render_report(report, width=100))
    markdown = markdown_render.render_report(report)
    for f in report.findings:
        if f.severity.value == "info":
            assert not f.fix
            continue
        assert f.fix
        assert f"(more: gradaudit explain {f.code})" in terminal
        assert f"(more: `gradaudit explain {f.code}`)" in markdown
    # The sample is FSDP2: its GA201 fix is the FSDP2 sentence, not the FSDP1 or DeepSpeed one.
    ga201 = finding(report, "GA201")
    assert ga201.fix.startswith("With FSDP2") and "FSDP1" not in ga201.fix and "DeepSpeed" not in ga201.fix
    MarkdownIt().parse(markdown)


def test_the_fix_line_follows_the_stack_the_dump_shows(tmp_path):
    # Flat ranges of a flattened parameter, as FSDP1 dumps them.
    grads = [tensor_with_norm(0.8, (6,), seed=r, dtype=torch.float64) for r in range(2)]
    fsdp1 = write_step(
        tmp_path / "fsdp1",
        world_size=2,
        params={"w": (3, 4)},
        pieces={r: [flat("w", 6 * r, grads[r])] for r in range(2)},
        clips={r: clip(1.0, reported_norm=0.8, clip_coef=1.0) for r in range(2)},
    )
    fix = finding(check(fsdp1), "GA201").fix
    assert fix.startswith("With FSDP1") and "FSDP.clip_grad_norm_" in fix
    # Without a stack to go by, the whole text of the explanation.
    whole_text = "With A, do a. Otherwise, do b."
    assert fix_for(whole_text, None) == whole_text and fix_for(whole_text, "DDP") == whole_text


def test_ranks_sharing_an_explanation_share_one_sentence_said_once(tmp_path):
    report = check(_local_clip(tmp_path / "s"))
    ga201 = finding(report, "GA201")
    assert (
        "ranks 0-3: reported norm" in ga201.message and "matches each rank's own pieces only" in ga201.message
    )
    assert "rank 1:" not in ga201.message
    for text in (terminal_render.render_report(report, width=100), markdown_render.render_report(report)):
        said = _words(text)
        assert said.count("own pieces only") == 1, said


def test_fold_sentences_keeps_apart_what_differs_in_words_and_ranges_numbers():
    folded = fold_sentences(
        [
            (0, "reported norm 0.4 matches rank 0's own pieces only (0.4)"),
            (1, "reported norm 0.6 matches rank 1's own pieces only (0.6)"),
            (2, "reported norm 1.5 matches ranks [2, 3] of group dp, replicas once"),
            (3, "reported norm 1.5 matches ranks [2, 3] of group dp, replicas once"),
            (4, "reported norm 0.7 matches rank 4's own pieces only, unlike rank 2"),
        ]
    )
    assert [(f.ranks, f.text) for f in folded] == [
        ((0, 1), "reported norm 0.4–0.6 matches each rank's own pieces only (0.4–0.6)"),
        ((2, 3), "reported norm 1.5 matches ranks [2, 3] of group dp, replicas once"),
        ((4,), "reported norm 0.7 matches rank 4's own pieces only, unlike rank 2"),
    ]


def test_a_long_message_is_cut_between_clauses_never_inside_one():
    message = "; ".join(f"group {i}: reported norm {i}.123456 matches nothing known" for i in range(40))
    cut = clip_sentences(message, 600, rest="… (the JSON report has the rest)")
    assert len(cut) <= 600 and cut.endswith("… (the JSON report has the rest)")
    assert re.search(r"matches nothing known; … \(the JSON report has the rest\)$", cut)


def test_markdown_of_many_distinct_explanations_stays_in_budget_without_cutting_a_sentence(tmp_path):
    # 64 ranks, each clipping by its own norm: one folded sentence, whatever the world size.
    report = check(_local_clip(tmp_path / "s", num_ranks=64, shard_norm=0.05))
    markdown = markdown_render.render_report(report)
    assert len(markdown) <= markdown_render.MAX_CHARS
    assert "ranks 0-63: reported norm" in markdown and "left out to keep this report short" not in markdown
    assert "rank 3:…" not in markdown
    MarkdownIt().parse(markdown)


def test_a_wrong_norm_on_a_step_below_max_norm_says_the_update_was_unaffected(tmp_path):
    below = finding(check(_local_clip(tmp_path / "below", shard_norm=0.1)), "GA201")
    assert "This step's update was unaffected" in below.message
    assert "first step whose true norm is above max_norm" in below.message
    above = finding(check(_local_clip(tmp_path / "above", shard_norm=0.8)), "GA201")
    assert "unaffected" not in above.message


def test_version_option_prints_the_version(cli):
    code, out, _ = cli("--version")
    assert code == 0
    assert out == f"gradaudit {__version__} (dump format 1.1)\n"
    # also through typer, where --help lists it
    assert "--version" in cli("--help").stdout


def _run_folder(root: Path, failing: set[int], num_steps: int) -> Path:
    for step in range(1, num_steps + 1):
        grads = [
            tensor_with_norm(0.8 if step in failing else 0.2, (2, 3), seed=r, dtype=torch.float64)
            for r in range(2)
        ]
        if step in failing:
            clips = clip(1.0, reported_norm=float(grads[0].norm()), clip_coef=1.0)
        else:
            clips = clip(1.0, reported_norm=float(torch.cat(grads).norm()), clip_coef=1.0)
        sharded_rows(root / f"step_{step}", grads, clips=clips, step=step)
    return root


def _summary_rows(terminal: str) -> list[str]:
    """The step cells of the summary table (its rows end with the errors, warnings and codes columns)."""
    return [
        line.split()[0] for line in terminal.splitlines() if re.match(r"^\s*\d.*\d+\s+\d+\s+(GA|-)", line)
    ]


def test_a_run_folder_lists_failing_steps_first_and_folds_the_clean_ones(tmp_path, cli):
    run = _run_folder(tmp_path / "run", failing={4, 9}, num_steps=12)
    code, out, _ = cli("check", str(run))
    assert code == 1
    rows = _summary_rows(out)
    assert rows == ["4", "9", "1–3", "5–8", "10–12"], out
    assert "12 steps (2 failing)" in out and "step 5 ─" not in out
    assert "· fix: gradaudit explain GA201" in out
    code, markdown, _ = cli("check", str(run), "--format", "markdown")
    assert "(fix: `gradaudit explain GA201`)" in markdown
    assert "| 1–3 (3 steps) |" in markdown and markdown.index("| 4 |") < markdown.index("| 1–3 (3 steps) |")
    MarkdownIt().parse(markdown)


def test_failing_only_prints_only_the_failing_steps(tmp_path, cli):
    run = _run_folder(tmp_path / "run", failing={4}, num_steps=6)
    code, out, _ = cli("check", str(run), "--failing-only")
    rows = _summary_rows(out)
    assert code == 1 and rows == ["4"] and "5 clean steps not listed (--failing-only)" in out
    code, markdown, _ = cli("check", str(run), "--failing-only", "--format", "markdown")
    assert "| 4 |" in markdown and "(3 steps)" not in markdown and "5 clean steps not listed" in markdown


def test_hints_and_fixes_name_the_api_the_dump_was_captured_with(tmp_path):
    from gradaudit.capture.build import write_rank

    grads = [tensor_with_norm(0.8, (6,), seed=r, dtype=torch.float64) for r in range(2)]
    for rank in range(2):
        write_rank(
            tmp_path / "zero",
            rank=rank,
            world_size=2,
            step=1,
            params={"w": (12,)},
            pieces=[flat("w", 6 * rank, grads[rank])],
            clip=clip(1.0, reported_norm=0.8, clip_coef=1.0),
            capture_api="DeepSpeedAudit",
        )
    report = check(tmp_path / "zero")
    reason = next(n.reason for n in report.not_checked if n.code == "GA701")
    assert "DeepSpeedAudit" in reason and "audit_step" not in reason
    fix = finding(report, "GA201").fix
    assert fix.startswith("With DeepSpeed") and "gradient_clipping" in fix  # flat ranges, yet not FSDP1


def test_a_dump_that_does_not_record_its_api_still_loads_and_hints_in_general_terms(tmp_path):
    report = check(_local_clip(tmp_path / "old"))  # written without capture_api, as before it existed
    reason = next(n.reason for n in report.not_checked if n.code == "GA701")
    assert "pass optimizer= to audit_step or begin_audit" in reason
    assert check(REPO / "sample_dumps" / "fsdp2_local_clip" / "step_1").findings


def _sample(name: str):
    return check(REPO / "sample_dumps" / name / "step_1")


def test_a_ddp_replica_is_drawn_as_the_copy_of_its_owner_not_as_a_rank_with_no_gradient():
    report = _sample("clip_per_microbatch")
    terminal = terminal_render.render_report(report, width=100)
    chart_rank_1 = next(line for line in terminal.splitlines() if line.strip().startswith("rank 1 "))
    assert "copy of rank 0, counted there" in chart_rank_1 and "0.0%" not in chart_rank_1
    markdown = markdown_render.render_report(report)
    assert "| copy of rank 0, counted there |" in markdown or "copy of rank 0, counted there" in markdown


def test_the_rank_table_says_which_clip_call_or_copy_a_correct_norm_is_right_for():
    terminal = terminal_render.render_report(_sample("clip_per_microbatch"), width=100)
    table = terminal.split("Share of the squared")[0]
    assert re.search(r"correct \(last of 2 calls\)", table) and not re.search(r"correct\s+0\n", table)
    drifted = terminal_render.render_report(_sample("ddp_drifted_replicas"), width=100)
    assert "correct (own drifted copy)" in drifted


def test_ddp_reports_do_not_say_local_only_is_indistinguishable_where_it_changes_nothing():
    for name in ("clip_per_microbatch", "clip_before_unscale", "ddp_drifted_replicas"):
        report = _sample(name)
        text = terminal_render.render_report(report, width=100) + markdown_render.render_report(report)
        assert "indistinguishable here from" not in text, name


def _mermaid_blocks(markdown: str) -> list[str]:
    tokens = MarkdownIt().parse(markdown)
    return [t.content for t in tokens if t.type == "fence" and t.info == "mermaid"]


def test_markdown_draws_each_ranks_share_as_a_chart_github_renders_with_a_table_beside_it():
    report = _sample("fsdp2_local_clip")
    markdown = markdown_render.render_report(report)
    (chart,) = _mermaid_blocks(markdown)
    assert chart.startswith("xychart-beta\n")
    bars = re.search(r"bar \[(.*)\]", chart).group(1).split(", ")
    assert bars == ["0.230155", "0.310197", "0.4861", "0.855294", "1.88175"]
    assert re.search(r"line \[1, 1, 1, 1, 1\]", chart)  # max_norm² across the bars
    assert (
        "| all ranks | 1.88175 | 100.0% | **above** |" in markdown
        and "| rank 3 | 0.855294 | 45.5% | below |" in markdown
    )


def test_a_run_folders_markdown_draws_the_trend_with_failing_steps_marked(tmp_path, cli):
    run = _run_folder(tmp_path / "run", failing={4, 9}, num_steps=12)
    _, markdown, _ = cli("check", str(run), "--format", "markdown")
    (chart,) = _mermaid_blocks(markdown)
    labels = re.search(r"x-axis \[(.*)\]", chart).group(1).split(", ")
    assert labels[3] == '"4 ✗"' and labels[8] == '"9 ✗"' and labels[0] == '"1"' and len(labels) == 12
    assert len(re.findall(r"^\s*line \[", chart, flags=re.M)) == 3  # true, reported, max_norm


def test_charts_stay_bounded_at_any_world_size_and_step_count(tmp_path):
    from gradaudit.render.charts import MAX_CHART_RANKS, MAX_TREND_STEPS, trend_points
    from gradaudit.report.model import MultiStepReport, StepSummary

    report = check(_local_clip(tmp_path / "s", num_ranks=64, shard_norm=0.05))
    (chart,) = _mermaid_blocks(markdown_render.render_report(report))
    assert len(re.search(r"bar \[(.*)\]", chart).group(1).split(", ")) == MAX_CHART_RANKS + 1
    summary = tuple(
        StepSummary(
            step=s,
            directory="",
            global_norm=1.0,
            reported_norm=1.0,
            expected_clip_coef=1.0,
            num_errors=0,
            num_warnings=0,
            codes=(),
        )
        for s in range(1, 1001)
    )
    points = trend_points(MultiStepReport(directory="", steps=(), summary=summary), {500, 999})
    assert len(points) == MAX_TREND_STEPS and {500, 999} <= {p.step for p in points}
