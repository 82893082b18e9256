"""The guard's pure half: a gathered live step is diagnosed by the pipeline `gradaudit check` runs, the
dump the guard writes loads and is marked guard-triggered, and the trend file reads back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.checks.fixes import stack_of
from gradaudit.cli import main
from gradaudit.dumpfile.writer import write_rank_file
from gradaudit.errors import StepFolderError
from gradaudit.live.analysis_input import (
    CallSummary,
    LiveStep,
    OwnershipGroup,
    RankSummary,
    rank_dumps,
    report_of,
    step_dump,
)
from gradaudit.live.trend import TREND_FILE, TrendLine, read_trend, trend_text
from gradaudit.model import Topology

MAX_NORM = 1.0


def _coef(norm: float) -> float:
    return min(1.0, MAX_NORM / (norm + 1e-6))


def live_step(terms, reported, *, replicated=False, calls=1, directory=""):
    """Two ranks; `terms[r]` is rank r's sum of squares, `reported[r]` what its clip call returned."""
    group = OwnershipGroup(name="dp" if replicated else "sharded", replica_group="dp" if replicated else None)
    topology = Topology(groups={"dp": ((0, 1),)})
    ranks = {
        rank: RankSummary(
            rank=rank,
            terms=(terms[rank],),
            held=(True,),
            applied_coef=_coef(reported[rank]),
            calls=tuple(
                CallSummary(
                    reported_norm=reported[rank], max_norm=MAX_NORM, norm_type=2.0, terms=(terms[rank],)
                )
                for _ in range(calls)
            ),
            num_calls=calls,
            topology=topology,
        )
        for rank in (0, 1)
    }
    return LiveStep(
        step=5,
        world_size=2,
        max_norm=MAX_NORM,
        norm_type=2.0,
        groups=(group,),
        ranks=ranks,
        directory=directory,
    )


def errors(report):
    return sorted({f.code for f in report.findings if f.severity.name == "ERROR"})


def test_a_correct_sharded_step_has_no_error():
    true = math.sqrt(0.6 + 0.9)
    assert errors(report_of(live_step((0.6, 0.9), (true, true)))) == []


def test_a_local_norm_is_ga201_and_replicas_counted_twice_are_ga202():
    assert "GA201" in errors(report_of(live_step((0.6, 0.9), (math.sqrt(0.6), math.sqrt(0.9)))))
    # replicated over dp (DDP): each rank holds the whole gradient, the true norm counts it once
    doubled = math.sqrt(2 * 1.5)
    report = report_of(live_step((1.5, 1.5), (doubled, doubled), replicated=True))
    assert report.global_norm == pytest.approx(math.sqrt(1.5))
    assert "GA202" in errors(report)


def test_two_clip_calls_in_one_step_are_ga501():
    true = math.sqrt(1.5)
    assert "GA501" in errors(report_of(live_step((0.6, 0.9), (true, true), calls=2)))


def test_the_guard_dump_loads_and_check_marks_it_guard_triggered(tmp_path):
    live = live_step((0.6, 0.9), (math.sqrt(0.6), math.sqrt(0.9)), directory=str(tmp_path / "step_5"))
    import dataclasses

    for rank, dump in rank_dumps(live).items():
        write_rank_file(live.directory, dataclasses.replace(dump, trigger="guard"), {})
        assert rank in (0, 1)
    report = audit_folder(live.directory, AuditOptions())
    assert errors(report) == errors(report_of(live))
    assert [f.message for f in report.findings] == [f.message for f in report_of(live).findings]
    assert any(w.startswith("guard-triggered") for w in report.warnings)


def test_the_guard_dump_records_its_api_and_its_group_pieces_name_no_fsdp1_fix():
    live = live_step((0.6, 0.9), (math.sqrt(0.6), math.sqrt(0.9)))
    step = step_dump(live)
    assert {step.ranks[r].capture_api for r in step.ranks_present} == {"guard"}
    assert stack_of(step) is None  # one-element flat ranges per group: no stack shows in them
    ga201 = next(f for f in report_of(live).findings if f.code == "GA201")
    assert "With FSDP1" not in ga201.message


def _trend(tmp_path, lines):
    (tmp_path / TREND_FILE).write_text("".join(json.dumps(line.to_json()) + "\n" for line in lines))
    return tmp_path


def _line(step, codes=(), true=1.2, reported=1.2):
    return TrendLine(
        step=step,
        true_norm=true,
        reported_norm=reported,
        expected_coef=0.8,
        min_coef=0.8,
        max_coef=0.8,
        codes=codes,
    )


def test_the_trend_reads_back_and_lists_the_failing_steps_first(tmp_path):
    lines = [_line(1), _line(2, ("GA201",), reported=0.7), _line(3, reported=math.inf)]
    folder = _trend(tmp_path, lines)
    assert read_trend(folder / TREND_FILE) == lines
    text = trend_text(lines)
    assert text.splitlines()[0] == "guard trend: 3 checked steps, 1 with wrong clipping"
    assert text.splitlines()[1].startswith("  step 2: GA201")


def test_a_damaged_trend_line_names_the_file_and_line(tmp_path):
    (tmp_path / TREND_FILE).write_text(json.dumps(_line(1).to_json()) + "\n{not json\n")
    with pytest.raises(StepFolderError, match=r"guard_trend.jsonl:2: .*remove the line"):
        read_trend(tmp_path / TREND_FILE)


def run(*argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out, err = capsys.readouterr()
    return exited.value.code, out, err


def test_check_of_a_guarded_run_folder_shows_the_trend(tmp_path, capsys):
    (tmp_path / "clean").mkdir()
    (tmp_path / "bad").mkdir()
    code, out, _ = run("check", str(_trend(tmp_path / "clean", [_line(1), _line(2)])), capsys=capsys)
    assert code == 0 and out.startswith("guard trend: 2 checked steps, 0 with wrong clipping")
    code, out, _ = run(
        "check", str(_trend(tmp_path / "bad", [_line(1), _line(2, ("GA201",))])), capsys=capsys
    )
    assert code == 1 and "step 2: GA201" in out


def test_check_of_a_guarded_run_folder_lists_the_full_captures_beside_the_guards_dumps(tmp_path, capsys):
    import dataclasses

    (tmp_path / "run").mkdir()
    folder = _trend(tmp_path / "run", [_line(4), _line(5, ("GA201",), reported=0.7), _line(6)])
    wrong = live_step((0.6, 0.9), (math.sqrt(0.6), math.sqrt(0.9)), directory=str(folder / "step_5"))
    right = live_step((0.6, 0.9), (math.sqrt(1.5), math.sqrt(1.5)), directory=str(folder / "full" / "step_6"))
    for live, step in ((wrong, 5), (right, 6)):
        for dump in rank_dumps(live).values():
            write_rank_file(live.directory, dataclasses.replace(dump, step=step), {})
    result = audit_folder(folder, AuditOptions())
    assert [(s.step, Path(s.directory).relative_to(folder).as_posix()) for s in result.summary] == [
        (5, "step_5"),
        (6, "full/step_6"),
    ]
    code, out, _ = run("check", str(folder), capsys=capsys)
    assert (
        code == 1
        and f"step 6 captured in full (the step after an anomaly): gradaudit check {folder}/full/step_6"
        in out
    )
