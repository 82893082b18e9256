"""Every broken dump in the corpus gets its exact answer from every command that reads dumps."""

from __future__ import annotations

import re

import pytest

from .cli import COMMANDS, assert_clean_refusal, run_cli
from .corpus import CORPUS, Case, edit_metadata, rank_path, write_valid_step

REFUSALS = [case for case in CORPUS if case.exit_codes is None]
FINDINGS = {case.name: case for case in CORPUS if case.exit_codes is not None}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", REFUSALS, ids=lambda case: case.name)
def test_each_broken_dump_is_refused_with_one_line_naming_the_file_and_the_problem(
    tmp_path, capsys, case: Case, command
):
    target, culprit = case.build(tmp_path)
    outcome = run_cli(capsys, command, str(target))
    assert_clean_refusal(outcome, names=culprit, problem=case.problem)


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_rank_is_reported_and_the_other_ranks_are_still_audited(tmp_path, capsys, command):
    case = FINDINGS["a missing rank"]
    target, _ = case.build(tmp_path)
    outcome = run_cli(capsys, command, str(target))
    assert outcome.code == case.exit_codes[command], outcome.stderr
    assert "Traceback" not in outcome.stderr
    if command == "show":
        assert "ranks present 1; missing 1" in outcome.stdout
    else:
        assert "GA100" in outcome.stdout
        assert "GA100" in run_cli(capsys, command, str(target), "--format", "json").stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_a_stray_file_beside_the_dumps_is_ignored_with_a_warning_naming_it(tmp_path, capsys, command):
    case = FINDINGS["a stray file beside the dumps"]
    target, culprit = case.build(tmp_path)
    outcome = run_cli(capsys, command, str(target))
    assert outcome.code == case.exit_codes[command], outcome.stderr
    shown = " ".join((outcome.stdout + outcome.stderr).split())  # the terminal renderer may wrap lines
    assert f"{culprit}: ignored, not a rank file" in shown


@pytest.mark.parametrize("command", COMMANDS)
def test_a_stats_only_piece_claiming_1e15_elements_is_audited_without_allocating_it(
    tmp_path, capsys, command
):
    import resource

    case = FINDINGS["a stats-only piece claiming 10^15 elements"]
    target, culprit = case.build(tmp_path)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcome = run_cli(capsys, command, str(target))
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert outcome.code == case.exit_codes[command], outcome.stderr
    assert (culprit if command == "show" else "True global L2 norm") in outcome.stdout
    assert peak_after - peak_before < 200 * 1024, "more than 200 MiB allocated for a 10^15-element claim"


@pytest.mark.parametrize(
    ("command", "case_name"),
    [("show", "a file truncated in the data"), ("check", "a rank file that is a named pipe")],
)
def test_a_real_gradaudit_process_answers_a_broken_dump_with_exit_2_and_one_line(
    tmp_path, command, case_name
):
    import subprocess
    import sys

    case = next(c for c in CORPUS if c.name == case_name)
    target, culprit = case.build(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "gradaudit", command, str(target)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and culprit in done.stderr
    assert re.search(case.problem, done.stderr.strip())


@pytest.mark.parametrize("command", COMMANDS)
def test_one_file_claiming_a_huge_world_size_gives_a_short_report(tmp_path, capsys, command):
    """A 2 KiB file may claim 4096 ranks; the missing ones must be summarised as ranges, not listed
    one by one (at the 2^20 ranks the format allows, listing them took 80 s and 63 MB of output)."""
    step_dir = write_valid_step(tmp_path / "step_7")
    rank_path(step_dir, 1).unlink()
    edit_metadata(rank_path(step_dir, 0), lambda doc: doc.__setitem__("world_size", 4096))
    outcome = run_cli(capsys, command, str(step_dir))
    assert outcome.code == (0 if command == "show" else 1), outcome.stderr
    assert "4095" in outcome.stdout
    assert len(outcome.stdout) < 16_000, f"{len(outcome.stdout)} characters of output for one missing range"
