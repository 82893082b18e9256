"""Command-line conventions: colour by --color, NO_COLOR and FORCE_COLOR; status lines on stderr, the
report alone on stdout; counts with their noun in the singular when there is one; and one progress
count over a run folder's steps."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from goldens import RENDERER_GOLDENS, SAMPLE_GOLDENS

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.render import markdown as markdown_render
from gradaudit.render import terminal as terminal_render
from gradaudit.render.fold import fmt_groups
from gradaudit.render.guardtrend import not_dumped
from gradaudit.report.model import MultiStepReport, TrendStep, guard_trend

REPO = Path(__file__).resolve().parents[2]
STEP = REPO / "sample_dumps" / "fsdp2_local_clip" / "step_1"
ESC = "\x1b["


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Neither colour variable set, whatever the shell running the tests has."""
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    return monkeypatch


# ---------------------------------------------------------------- colour (stdout is a pipe here)

COLOUR_CASES = [
    ({}, [], False),
    ({}, ["--color", "always"], True),
    ({"FORCE_COLOR": "1"}, [], True),
    ({"FORCE_COLOR": "0"}, [], False),
    ({"NO_COLOR": "1"}, [], False),
    ({"NO_COLOR": "1", "FORCE_COLOR": "1"}, [], False),
    ({"NO_COLOR": "1"}, ["--color", "always"], True),
    ({"FORCE_COLOR": "1"}, ["--color", "never"], False),
]


@pytest.mark.parametrize(("env", "option", "coloured"), COLOUR_CASES)
@pytest.mark.parametrize("command", ["check", "show"])
def test_piped_output_is_coloured_only_when_forced_and_the_option_wins_over_the_environment(
    cli, plain_env, env, option, coloured, command
):
    for name, value in env.items():
        plain_env.setenv(name, value)
    code, out, _ = cli(command, str(STEP), *option)
    assert code in (0, 1)
    assert (ESC in out) is coloured
    plain = [line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", out).splitlines()]
    assert plain == cli(command, str(STEP), "--color", "never")[1].splitlines()  # styling only


def test_a_report_written_to_a_file_has_no_colour_unless_asked_for_with_always(cli, plain_env, tmp_path):
    plain_env.setenv("FORCE_COLOR", "1")
    target = tmp_path / "report.txt"
    cli("check", str(STEP), "--output", str(target))
    assert ESC not in target.read_text(encoding="utf-8")
    cli("check", str(STEP), "--output", str(target), "--color", "always")
    assert ESC in target.read_text(encoding="utf-8")


def test_an_unknown_colour_choice_is_a_usage_error(cli):
    code, out, err = cli("check", str(STEP), "--color", "sometimes")
    assert code == 2 and out == "" and "sometimes" in err


# ---------------------------------------------------------------- stdout is for the report


def test_the_output_options_status_line_goes_to_stderr_and_stdout_stays_empty(cli, tmp_path):
    target = tmp_path / "report.md"
    code, out, err = cli("check", str(STEP), "--format", "markdown", "--output", str(target))
    assert code == 1 and out == ""
    assert err == f"report written to {target}\n"
    assert target.read_text(encoding="utf-8").startswith("# gradaudit report: step 1")


def test_the_demos_wrote_and_next_lines_go_to_stderr(cli, monkeypatch, tmp_path):
    import gradaudit.demo

    done = SimpleNamespace(
        step_dir=tmp_path / "fsdp2_correct" / "step_1",
        reference_step_dir=tmp_path / "fsdp2_correct" / "reference" / "step_1",
        check_command="gradaudit check x --reference y",
    )
    monkeypatch.setattr(gradaudit.demo, "run_demo", lambda scenario, out_dir, progress: done)
    code, out, err = cli("demo", "fsdp2_correct", str(tmp_path))
    assert code == 0 and out == ""
    assert f"wrote {done.step_dir} (" in err and err.endswith("next: gradaudit check x --reference y\n")


# ---------------------------------------------------------------- one, many

ONE_OF_MANY = re.compile(
    r"(?<![\d.,])1 (?:more |smaller |clean |failing |checked )?"
    r"(steps|ranks|groups|findings|warnings|explanations|rows|errors|parameters|step folders)\b"
    r"|\b(?:in|of) steps \d+\b(?![-–,\d])"
)


def _texts() -> dict[str, str]:
    folders = [RENDERER_GOLDENS, SAMPLE_GOLDENS]
    return {p.name: p.read_text(encoding="utf-8") for folder in folders for p in sorted(folder.iterdir())}


def test_no_golden_report_says_one_with_a_plural_noun_or_steps_before_a_single_step():
    wrong = {name: ONE_OF_MANY.findall(text) for name, text in _texts().items() if ONE_OF_MANY.search(text)}
    assert wrong == {}


def test_the_plural_check_itself_catches_the_old_wordings():
    for old in ("No errors, warnings or missing ranks in steps 7.", "  1 clean steps not listed", "1 groups"):
        assert ONE_OF_MANY.search(old), old
    for right in ("in step 7.", "in steps 7-9.", "in steps 1, 3.", "1 clean step not listed", "11 steps"):
        assert not ONE_OF_MANY.search(right), right


def test_one_clean_step_left_out_is_one_clean_step_in_both_human_formats():
    from render.reports import multi_report

    multi = multi_report()
    terminal = terminal_render.render_multi(multi, failing_only=True)
    markdown = markdown_render.render_multi(multi, failing_only=True)
    assert "  1 clean step not listed (--failing-only)" in terminal
    assert "1 clean step not listed (--failing-only)." in markdown


def test_groups_of_one_rank_and_a_single_step_not_dumped_are_singular():
    assert fmt_groups([[0], [1]]) == "2 groups of 1 rank: {0}, {1}"
    assert fmt_groups([[0, 1]]) == "1 group of 2 ranks: {0-1}"
    trend = guard_trend(
        [TrendStep(step=3, verdict="anomaly", codes=("GA201",)), TrendStep(step=4, verdict="ok")],
        file="t",
        dumps={},
    )
    assert not_dumped(trend).startswith("1 failing step not dumped (")
    assert not_dumped(trend).endswith(": step 3; only the trend has it")
    multi = MultiStepReport(directory="run", steps=(), summary=(), guard_trend=trend)
    assert terminal_render.render_multi(multi).startswith(
        "guard trend: 2 checked steps, 1 with wrong clipping"
    )


# ---------------------------------------------------------------- progress over a run folder


def test_a_run_folders_steps_advance_one_progress_count_instead_of_restarting_it(tmp_path):
    for step in (1, 2, 3):
        shutil.copytree(STEP, tmp_path / f"step_{step}")
    seen: list[tuple[int, int]] = []
    audit_folder(tmp_path, AuditOptions(), progress=lambda done, total: seen.append((done, total)))
    num_params = 4  # fc1 and fc2, weight and bias
    assert {total for _, total in seen} == {3 * num_params}
    assert [done for done, _ in seen] == list(range(1, 3 * num_params + 1))
