"""The guard's pure half: a gathered live step is diagnosed by the pipeline `gradaudit check` runs, the
dump the guard writes loads and is marked guard-triggered, and the trend file reads back."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from builders import assert_same_tables

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.checks.fixes import stack_of
from gradaudit.dumpfile.loader import assemble_step
from gradaudit.dumpfile.writer import write_rank_file
from gradaudit.errors import StepFolderError
from gradaudit.live.analysis_input import (
    CallSummary,
    LiveStep,
    OwnershipGroup,
    RankSummary,
    rank_dump,
    report_of,
)
from gradaudit.live.trend import TREND_FILE, Trend, TrendLine, read_trend
from gradaudit.model import Topology
from live.trends import skipped_line, write_trend

MAX_NORM = 1.0


def step_dump(live):
    """The live step as the loader gives it after reading every rank's dump the guard would write."""
    return assemble_step(live.directory, {rank: rank_dump(live, rank) for rank in sorted(live.ranks)})


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

    for rank, dump in step_dump(live).ranks.items():
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


def test_the_trend_reads_back_and_lists_the_failing_steps_first(tmp_path, cli):
    lines = [_line(1), _line(2, ("GA201",), reported=0.7), _line(3, reported=math.inf)]
    folder = write_trend(tmp_path, lines)
    trend = read_trend(folder / TREND_FILE)
    assert trend == Trend(path=str(folder / TREND_FILE), lines=tuple(lines))
    _, out, _ = cli("check", str(folder))
    assert out.splitlines()[0] == "guard trend: 3 checked steps, 1 with wrong clipping"
    assert out.splitlines()[1].startswith("  step 2: GA201")


def test_a_step_clipped_twice_keeps_its_clip_calls_in_the_trend_and_names_the_last_as_the_coefficients(
    tmp_path, cli
):
    twice = replace(_line(2, ("GA501",), true=71.0, reported=71.0), min_coef=0.5, clip_calls=2)
    lines = [_line(1), twice]
    folder = write_trend(tmp_path, lines)
    assert read_trend(folder / TREND_FILE).lines == tuple(lines)
    assert "clip_calls" not in _line(1).to_json() and twice.to_json()["clip_calls"] == 2  # once: as before
    _, out, _ = cli("check", str(folder))
    assert (
        "(true norm 71, reported 71, coefficients applied by the last of 2 clip calls 0.5..0.8)"
        in " ".join(out.split())
    )


def test_a_step_the_scaler_skipped_reads_back_as_skipped_and_not_failing(tmp_path, cli):
    skipped = skipped_line(2)
    lines = [_line(1), skipped, _line(3)]
    folder = write_trend(tmp_path, lines)
    assert read_trend(folder / TREND_FILE).lines == tuple(lines)
    assert skipped.to_json()["verdict"] == "skipped"
    code, out, _ = cli("check", str(folder))
    assert code == 0
    assert (
        out.splitlines()[0] == "guard trend: 3 checked steps, 0 with wrong clipping, 1 skipped by the scaler"
    )
    assert any(
        row.strip().startswith("2 ") and row.endswith("skipped by the scaler") for row in out.splitlines()
    )


def test_a_damaged_trend_line_names_the_file_and_line(tmp_path):
    (tmp_path / TREND_FILE).write_text(json.dumps(_line(1).to_json()) + "\n{not json\n")
    with pytest.raises(StepFolderError, match=r"guard_trend.jsonl:2: not JSON .*remove the line"):
        read_trend(tmp_path / TREND_FILE)


def test_check_of_a_guarded_run_folder_shows_thewrite_trend(tmp_path, cli):
    (tmp_path / "clean").mkdir()
    (tmp_path / "bad").mkdir()
    code, out, _ = cli("check", str(write_trend(tmp_path / "clean", [_line(1), _line(2)])))
    assert code == 0 and out.startswith("guard trend: 2 checked steps, 0 with wrong clipping")
    code, out, _ = cli("check", str(write_trend(tmp_path / "bad", [_line(1), _line(2, ("GA201",))])))
    assert code == 1 and "step 2: GA201" in out


def _random_live_step(seed):
    """Four ranks (dp 2 x tp 2), a sharded group and groups replicated over dp or over every rank,
    random terms, coefficients, nonfinite groups, replicas that differ and clip calls."""
    import random

    rng = random.Random(seed)
    norm_type = rng.choice((2.0, 2.0, 1.0, 3.0, math.inf))
    groups = (
        OwnershipGroup(name="sharded", replica_group=None),
        OwnershipGroup(name="dp", replica_group="dp", dtype=rng.choice(("float32", "bfloat16"))),
        OwnershipGroup(name="world", replica_group="world"),
    )
    topology = Topology(groups={"dp": ((0, 2), (1, 3)), "tp": ((0, 1), (2, 3)), "world": ((0, 1, 2, 3),)})
    num_calls = rng.choice((1, 1, 2, 3))
    step_coef = rng.choice((None, 1.0, rng.uniform(0.1, 1.0), rng.uniform(0.1, 1.0), math.nan))
    nonfinite_rank = rng.choice((None, None, None, 1))
    nonfinite_replica, drifting = rng.random() < 0.3, rng.random() < 0.3
    by_class: dict[tuple[int, tuple[int, ...]], float] = {}
    ranks = {}
    for rank in range(4):
        held = (True, rng.random() < 0.8, rng.random() < 0.5)
        terms = []
        for i, group in enumerate(groups):
            members = (rank,) if group.replica_group is None else topology.group_of(group.replica_group, rank)
            by_class.setdefault((i, members), rng.choice((0.0, rng.uniform(0.1, 4.0), rng.uniform(0.1, 4.0))))
            drift = 1.01 if rank == 3 and i > 0 and drifting else 1.0  # rank 3's replica differs
            terms.append(by_class[(i, members)] * drift if held[i] else 0.0)
        nonfinite = rank == nonfinite_rank
        coef = step_coef if rng.random() < 0.9 else rng.choice((None, math.nan))
        local = max(terms) if math.isinf(norm_type) else sum(terms) ** (1 / norm_type)
        ranks[rank] = RankSummary(
            rank=rank,
            terms=tuple(terms),
            held=held,
            num_nan=(1 if nonfinite else 0, 1 if nonfinite and nonfinite_replica else 0, 0),
            applied_coef=coef,
            calls=tuple(
                CallSummary(
                    reported_norm=rng.choice((rng.uniform(0.5, 3.0), local)),
                    max_norm=MAX_NORM,
                    norm_type=norm_type,
                    terms=tuple(t * (c + 1) for t in terms),
                )
                for c in range(num_calls)
            ),
            num_calls=num_calls,
            topology=topology,
        )
    return LiveStep(step=3, world_size=4, max_norm=MAX_NORM, norm_type=norm_type, groups=groups, ranks=ranks)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("clipped_before_unscale", [False, True])
def test_the_analysis_of_the_live_summary_is_that_of_the_guard_dump(seed, clipped_before_unscale):
    """analysis_of(live) builds the step table and the replica sets from the gathered numbers; they,
    the diagnosis and the coefficients are what measuring the guard's stats-mode dump gives (the
    oracle); with gradients measured before GradScaler.unscale_, both divide the loss scale out alike."""
    import dataclasses

    from gradaudit.analysis.coverage import coverage_by_param
    from gradaudit.audit import analyse
    from gradaudit.dumpfile.reader import TensorReader
    from gradaudit.live.analysis_input import analysis_of
    from gradaudit.measure.measure import measure_step
    from gradaudit.model import StepFacts

    live = _random_live_step(seed)
    if clipped_before_unscale:
        scaled = {"loss_scale": 256.0, "unscaled": False, "skipped": False, "grad_dtype": "float16"}
        live = dataclasses.replace(
            live, ranks={r: dataclasses.replace(s, **scaled) for r, s in live.ranks.items()}
        )
    step = step_dump(live)
    with TensorReader(step) as reader:
        measured = measure_step(step, reader, workers=1)
    expected = analyse(step, measured, coverage=coverage_by_param(step), update_judgements={})
    ours = analysis_of(live)
    assert type(ours.step) is StepFacts  # no dump built: the facts alone
    assert ours.coverage == expected.coverage and list(ours.coverage) == list(expected.coverage)
    for field in ("step", "world_size", "missing_ranks", "inconsistencies", "ranks_present", "params"):
        assert getattr(ours.step, field) == getattr(expected.step, field), field
    for rank in step.ranks_present:
        facts, dump = ours.step.ranks[rank], step.ranks[rank]
        for field in dataclasses.fields(facts):
            assert getattr(facts, field.name) == getattr(dump, field.name), (rank, field.name)
    assert stack_of(ours.step) == stack_of(step)
    assert_same_tables(expected.table, ours.table)
    assert bool(ours.table.calls) == any(len(s.calls) > 1 for s in live.ranks.values())
    assert [pm.replica_sets for pm in measured.params.values()] == [
        pm.replica_sets for pm in ours.measurements.params.values()
    ]
    assert repr(expected.diagnosis) == repr(ours.diagnosis)
    assert (expected.param_coefficients, expected.value_clipping) == (
        ours.param_coefficients,
        ours.value_clipping,
    )


def test_check_of_a_guarded_run_folder_lists_the_full_captures_beside_the_guards_dumps(tmp_path, cli):
    import dataclasses

    (tmp_path / "run").mkdir()
    folder = write_trend(tmp_path / "run", [_line(4), _line(5, ("GA201",), reported=0.7), _line(6)])
    wrong = live_step((0.6, 0.9), (math.sqrt(0.6), math.sqrt(0.9)), directory=str(folder / "step_5"))
    right = live_step((0.6, 0.9), (math.sqrt(1.5), math.sqrt(1.5)), directory=str(folder / "full" / "step_6"))
    for live, step in ((wrong, 5), (right, 6)):
        for dump in step_dump(live).ranks.values():
            write_rank_file(live.directory, dataclasses.replace(dump, step=step), {})
    result = audit_folder(folder, AuditOptions())
    assert [(s.step, Path(s.directory).relative_to(folder).as_posix()) for s in result.summary] == [
        (5, "step_5"),
        (6, "full/step_6"),
    ]
    code, out, _ = cli("check", str(folder))
    assert (
        code == 1
        and f"step 6 captured in full (the step after an anomaly): gradaudit check {folder}/full/step_6"
        in out
    )
