"""Every broken dump in the corpus gets its exact answer from every command that reads dumps."""

from __future__ import annotations

import pytest

from .cli import COMMANDS, assert_clean_refusal, run_cli
from .corpus import CORPUS, Case

REFUSALS = [case for case in CORPUS if case.exit_codes is None]
FINDINGS = {case.name: case for case in CORPUS if case.exit_codes is not None}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", REFUSALS, ids=lambda case: case.name)
def test_each_broken_dump_is_refused_with_one_line_naming_the_file_and_the_problem(tmp_path, capsys, case: Case, command):
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
def test_a_stats_only_piece_claiming_1e15_elements_is_audited_without_allocating_it(tmp_path, capsys, command):
    import resource

    case = FINDINGS["a stats-only piece claiming 10^15 elements"]
    target, culprit = case.build(tmp_path)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcome = run_cli(capsys, command, str(target))
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert outcome.code == case.exit_codes[command], outcome.stderr
    assert (culprit if command == "show" else "True global L2 norm") in outcome.stdout
    assert peak_after - peak_before < 200 * 1024, "more than 200 MiB allocated for a 10^15-element claim"
