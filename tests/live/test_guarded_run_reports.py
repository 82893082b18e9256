"""Reports of a guarded run's folder (its trend, the guard's dumps): the trend is part of the report in
every format, a clean guarded run still prints one, and `gradaudit show` reads the folder too."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from goldens import RENDERER_GOLDENS, assert_golden

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.live.trend import TrendLine
from gradaudit.render import json as json_render
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.report.model import GuardTrend, MultiStepReport, TrendStep, guard_trend
from live.trends import clipped_line, skipped_line, write_trend

SAMPLES = Path(__file__).resolve().parents[2] / "sample_dumps"
NOT_DUMPED = (3, 4, 9)
"""Failing steps the guard warned about within its cooldown after step 1, so wrote no dump of."""
SKIPPED = 6


def failing_run_trend() -> list[TrendLine]:
    """20 steps: step 1 local-clipped (the guard dumps it), 3, 4 and 9 too within its cooldown (warned,
    not dumped), step 6 skipped by the scaler, the others clean."""
    lines = []
    for step in range(1, 21):
        if step == 1:
            lines.append(clipped_line(step, codes=("GA201",), true=1.37177, reported=0.479745))
        elif step in NOT_DUMPED:
            lines.append(clipped_line(step, codes=("GA201",), true=1.5, reported=0.75))
        elif step == SKIPPED:
            lines.append(skipped_line(step))
        else:
            lines.append(clipped_line(step, true=1.0 + step / 100, reported=1.0 + step / 100))
    return lines


@pytest.fixture
def guarded_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`audit/` (the guard's out_dir): the trend above and the dump of step 1 (the local-clip sample,
    a real step 1), reached by a relative path so that the reports name it alike on every machine."""
    monkeypatch.chdir(tmp_path)
    write_trend(Path("audit"), failing_run_trend())
    shutil.copytree(SAMPLES / "fsdp2_local_clip" / "step_1", "audit/step_1")
    return Path("audit")


@pytest.fixture
def clean_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`clean/`: five clean steps and nothing else (the guard dumps only what it finds wrong)."""
    monkeypatch.chdir(tmp_path)
    return write_trend(
        Path("clean"), [clipped_line(s, true=0.5 + s / 10, reported=0.5 + s / 10) for s in range(1, 6)]
    )


RENDERERS = {
    "terminal.txt": lambda multi: terminal_render.render_multi(multi, width=100),
    "md": markdown_render.render_multi,
    "json": json_render.render_multi,
}


def _audit(folder: Path) -> MultiStepReport:
    result = audit_folder(folder, AuditOptions())
    assert isinstance(result, MultiStepReport)
    return result


@pytest.mark.parametrize("suffix", sorted(RENDERERS))
def test_a_guarded_run_renders_its_trend_then_its_dumps_as_in_the_golden_file(request, guarded_run, suffix):
    assert_golden(request, RENDERER_GOLDENS / f"guarded_run.{suffix}", RENDERERS[suffix](_audit(guarded_run)))


@pytest.mark.parametrize("suffix", sorted(RENDERERS))
def test_a_clean_guarded_run_without_dumps_renders_a_short_report_as_in_the_golden_file(
    request, clean_run, suffix
):
    assert_golden(request, RENDERER_GOLDENS / f"guarded_clean.{suffix}", RENDERERS[suffix](_audit(clean_run)))


def test_every_failing_step_of_the_trend_is_in_the_markdown_not_only_the_dumped_one(guarded_run):
    markdown = markdown_render.render_multi(_audit(guarded_run))
    for step in (1, *NOT_DUMPED):
        assert f"- **step {step}** GA201" in markdown
    assert "**3 failing steps not dumped (guard max\\_dumps or cooldown): steps 3-4, 9" in markdown
    assert markdown.index("## Guard trend") < markdown.index("## Dumps: 1 step (1 failing)")
    assert "```text\n 9 ####" in markdown  # the chart, as a text block


def test_the_json_report_has_the_steps_warned_but_not_dumped_and_the_chart_as_data(guarded_run):
    trend = json.loads(json_render.render_multi(_audit(guarded_run)))["guard_trend"]
    assert trend["not_dumped"] == list(NOT_DUMPED)
    assert [(s["step"], s["dump"]) for s in trend["failing"]] == [(1, "audit/step_1")] + [
        (step, None) for step in NOT_DUMPED
    ]
    assert (trend["num_checked"], trend["num_clean"], trend["num_skipped"]) == (20, 15, 1)
    assert [s["step"] for s in trend["chart"]] == list(range(9, 21))
    assert trend["chart"][0]["verdict"] == "anomaly" and trend["chart"][1]["true_norm"] == 1.1


def test_check_of_a_clean_guarded_run_prints_a_report_in_every_format_and_exits_0(clean_run, cli):
    code, out, _ = cli("check", str(clean_run), "--format", "json")
    assert code == 0 and json.loads(out)["guard_trend"]["num_clean"] == 5
    code, out, _ = cli("check", str(clean_run), "--format", "markdown")
    assert code == 0 and "5 steps checked, all clean" in out
    code, out, _ = cli("check", str(clean_run))
    assert code == 0 and out.startswith("guard trend: 5 checked steps, 0 with wrong clipping")


def test_a_guarded_run_whose_failing_steps_have_no_dump_exits_1_unless_told_never(tmp_path, cli):
    folder = write_trend(tmp_path / "run", [clipped_line(1), clipped_line(2, codes=("GA201",), reported=0.7)])
    code, out, _ = cli("check", str(folder), "--format", "json")
    assert code == 1 and json.loads(out)["guard_trend"]["not_dumped"] == [2]
    code, _, _ = cli("check", str(folder), "--fail-on", "never")
    assert code == 0


def test_show_of_a_guarded_run_lists_the_trend_then_each_dump(guarded_run, cli):
    code, out, _ = cli("show", str(guarded_run))
    assert code == 0
    assert out.startswith("Run folder  audit: 1 step folder\nguard trend: 20 checked steps, 4 with wrong")
    assert out.index("step 9: GA201") < out.index("Step 1  audit/step_1") < out.index("fc1.weight")
    code, out, _ = cli("show", str(guarded_run), "--format", "json")
    shown = json.loads(out)
    assert code == 0 and [s["directory"] for s in shown["steps"]] == ["audit/step_1"]
    assert shown["guard_trend"]["not_dumped"] == list(NOT_DUMPED)


def test_show_of_a_clean_guarded_run_says_so_instead_of_refusing_the_folder(clean_run, cli):
    code, out, _ = cli("show", str(clean_run))
    assert code == 0 and "0 step folders" in out and "5 steps checked, all clean." in out


def _step(step: int, verdict: str = "ok", codes: tuple[str, ...] = ()) -> TrendStep:
    return TrendStep(step=step, verdict=verdict, codes=codes, true_norm=1.0, reported_norm=1.0)  # type: ignore[arg-type]


def test_the_trend_value_keeps_the_last_chart_steps_and_matches_failing_steps_with_their_dumps():
    failing = range(7, 92, 7)  # 13 steps: one more than the human formats list
    steps = [_step(s, "anomaly", ("GA201",)) if s in failing else _step(s) for s in range(1, 101)]
    trend = guard_trend(
        steps, file="run/guard_trend.jsonl", dumps={7: "run/step_7"}, full_captures=["run/full/step_8"]
    )
    assert [s.step for s in trend.chart] == list(range(89, 101))
    assert [(s.step, s.dump) for s in trend.failing[:2]] == [(7, "run/step_7"), (14, None)]
    assert trend.not_dumped == tuple(failing)[1:]
    assert (trend.num_checked, trend.num_clean, trend.num_skipped) == (100, 87, 0)
    multi = MultiStepReport(directory="run", steps=(), summary=(), guard_trend=trend)
    markdown = markdown_render.render_multi(multi)
    assert "- **step 84** GA201" in markdown and "- **step 91**" not in markdown
    assert "- and 1 more failing step; see" in markdown
    assert (
        "step 8 captured in full (the step after an anomaly): gradaudit check run/full/step\\_8" in markdown
    )
    terminal = terminal_render.render_multi(multi)
    assert "  (and 1 more failing step)\n" in terminal
    assert (
        "  step 8 captured in full (the step after an anomaly): gradaudit check run/full/step_8\n" in terminal
    )


def test_a_trend_step_and_a_trend_refuse_counts_that_do_not_add_up():
    with pytest.raises(ValueError, match="codes exactly when its verdict is 'anomaly'"):
        _step(1, "ok", ("GA201",))
    with pytest.raises(ValueError, match="must be the clean"):
        GuardTrend(file="t", num_checked=2, num_clean=1, num_skipped=0, failing=(), not_dumped=(), chart=())
    with pytest.raises(ValueError, match="not failing"):
        GuardTrend(file="t", num_checked=1, num_clean=1, num_skipped=0, failing=(), not_dumped=(1,), chart=())


def test_hostile_codes_and_paths_in_a_trend_are_shown_literally_and_never_break_a_block():
    hostile = "\x1b[31mGA201\n```[red]"
    trend = guard_trend(
        [replace(_step(1, "anomaly", (hostile,)), true_norm=2.0)],
        file="run/`x`/guard_trend.jsonl",
        dumps={},
    )
    multi = MultiStepReport(directory="run/@octocat", steps=(), summary=(), guard_trend=trend)
    terminal = terminal_render.render_multi(multi)
    assert "\x1b" not in terminal and "\\x1b[31mGA201\\n```[red]" in terminal
    markdown = markdown_render.render_multi(multi)
    assert "\x1b" not in markdown and "@&#8203;octocat" in markdown
    chart = markdown.split("````text\n", 1)[1]  # a fence longer than the code's backticks
    assert chart.index("\\x1b[31mGA201\\n```[red]") < chart.index("\n````\n")


def test_a_real_guarded_run_reports_the_steps_it_warned_about_within_its_cooldown(tmp_path):
    import warnings

    import torch

    import gradaudit

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradaudit.guard(model, max_norm=0.1, optimizer=opt, out_dir=tmp_path, cooldown=100):
            for _ in range(4):  # clipped once per micro-batch, twice a step: GA501 on every checked step
                opt.zero_grad()
                for _ in range(2):
                    model(torch.randn(4, 8)).pow(2).sum().backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
                opt.step()
    said = [str(w.message) for w in caught if "gradaudit guard" in str(w.message)]
    assert [int(m.group(1)) for w in said if (m := re.search(r"step (\d+): GA501", w))] == [1]
    assert "gradaudit guard: GA501 again at steps 3-4" in said  # folded; step 2 is captured in full
    warned = [1, 3, 4]
    multi = _audit(tmp_path)
    trend = multi.guard_trend
    assert trend is not None and trend.not_dumped == (3, 4)
    assert [Path(s.directory).relative_to(tmp_path).as_posix() for s in multi.summary] == [
        "step_1",
        "full/step_2",
    ]
    markdown = markdown_render.render_multi(multi)
    assert all(f"- **step {step}** GA501" in markdown for step in warned)
    assert "2 failing steps not dumped (guard max\\_dumps or cooldown): steps 3-4" in markdown
    terminal = terminal_render.render_multi(multi, width=200)
    assert (
        f"step 2 captured in full (the step after an anomaly): gradaudit check {tmp_path}/full/step_2"
        in terminal
    )
