"""gradaudit.guard on 2 gloo ranks: correct DDP and FSDP2 runs are never flagged, a local clip is
named at its step with the code `gradaudit check` gives for the dump the guard wrote, "raise" raises on
every rank, and a checked step costs one collective."""

from __future__ import annotations

import json

import guard_workers
import pytest
from launcher import run_ranks

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile.loader import load_step

pytestmark = pytest.mark.integration

WORLD_SIZE = 2


def _train(tmp_path, stack, mistake_at=(), **options):
    out = tmp_path / stack
    results = run_ranks(
        guard_workers.train, WORLD_SIZE, (str(out), stack, tuple(mistake_at), options), timeout_s=120
    )
    trend = [json.loads(line) for line in (out / "guard_trend.jsonl").read_text().splitlines()]
    return out, results, trend


CORRECT_STEPS = 20


@pytest.mark.parametrize("stack", ["ddp", "fsdp2"])
def test_correct_runs_are_never_flagged(tmp_path, stack):
    _, results, trend = _train(tmp_path, stack, num_steps=CORRECT_STEPS)
    for result in results:
        assert result["anomalies"] == [] and result["warnings"] == [] and result["dumps"] == []
    assert [line["step"] for line in trend] == list(range(1, CORRECT_STEPS + 1))
    assert all(line["verdict"] == "ok" for line in trend)
    for line in trend:  # every step clips (the norm is above max_norm): the norms agree
        assert line["true_norm"] > 0.1
        assert line["reported_norm"] == pytest.approx(line["true_norm"], rel=1e-5)
        assert line["coef_spread"] <= 1e-6 * line["max_coef"]  # float32 rounding of the sampled elements


def test_a_local_clip_under_fsdp2_is_named_at_its_first_step_with_the_code_check_gives(tmp_path):
    out, results, trend = _train(tmp_path, "fsdp2", mistake_at=(1, 2, 3, 4))
    for result in results:
        assert result["anomalies"][0][0] == 1
        assert "GA201" in result["anomalies"][0][1]
    # one line for the step, from rank 0; the other rank logs it at debug level
    assert [w for w in results[0]["warnings"] if "step 1: GA201" in w] != []
    assert [w for w in results[1]["warnings"] if "step 1: GA201" in w] == []
    assert any(line.startswith("gradaudit guard: step 1: GA201") for line in results[1]["logged"])
    assert trend[0]["verdict"] == "anomaly" and "GA201" in trend[0]["codes"]
    report = audit_folder(out / "step_1", AuditOptions())
    codes = sorted({f.code for f in report.findings if f.severity.name == "ERROR"})
    assert codes == sorted(results[0]["anomalies"][0][1])
    assert any(w.startswith("guard-triggered") for w in report.warnings)
    assert (out / "full" / "step_2").is_dir()  # the next step was captured in full
    full = audit_folder(out / "full" / "step_2", AuditOptions())
    assert "GA201" in {f.code for f in full.findings}
    # each file names what wrote it, so the reports' hints speak of the guard
    assert {d.capture_api for d in load_step(out / "step_1").ranks.values()} == {"guard"}
    assert {d.capture_api for d in load_step(out / "full" / "step_2").ranks.values()} == {"guard.full"}
    # the default cooldown: one dump for a mistake that persists
    assert [len(r["dumps"]) for r in results] == [1, 1]


def test_an_intermittent_local_clip_on_the_step_a_ranks_batch_is_empty_is_caught_at_that_step_only(tmp_path):
    # rank 1's batch is empty at steps 2 and 3; only at step 3 does the clip go local
    out, results, trend = _train(tmp_path, "fsdp2", mistake_at=(3,), empty_at=(2, 3))
    for result in results:
        assert [step for step, _ in result["anomalies"]] == [3]
        assert "GA201" in result["anomalies"][0][1]
    assert [line["verdict"] for line in trend] == ["ok", "ok", "anomaly"]
    assert trend[1]["reported_norm"] == pytest.approx(trend[1]["true_norm"], rel=1e-5)  # empty, clipped right
    # step 4 is captured in full instead of checked live, and its clipping is right again
    full = audit_folder(out / "full" / "step_4", AuditOptions())
    assert [f.code for f in full.findings if f.severity.name == "ERROR"] == []


@pytest.mark.parametrize("late", [False, True])
def test_raise_raises_the_same_error_on_every_rank(tmp_path, late):
    _, results, _ = _train(tmp_path, "fsdp2", mistake_at=(2,), on_anomaly="raise", late=late)
    raised = [r["raised"] for r in results]
    assert raised[0] == raised[1]
    assert raised[0]["step"] == 2 and "GA201" in raised[0]["codes"]
    # read one step late, the verdict of step 2 stops the optimizer step of step 3
    assert raised[0]["at_step"] == (3 if late else 2)


@pytest.mark.parametrize("stack", ["ddp", "fsdp2"])
def test_a_passing_step_is_one_fixed_size_sum_and_a_failing_step_adds_one_gather(tmp_path, stack):
    """Counted at world sizes 2 and 4: a step whose numbers agree costs one all-reduce whose size does
    not depend on the world size; a failing step (and the first, judged in full) adds one all-gather
    of the ranks' rows; the step after an anomaly, captured in full, is one sum of statuses, and so is
    removing the guard."""
    sizes = {}
    for world_size in (2, 4):
        results = run_ranks(
            guard_workers.count_collectives,
            world_size,
            (str(tmp_path / str(world_size)), stack),
            timeout_s=180,
        )
        for result in results:
            first = result["with"] - result["without"]
            assert first == 3 + 1, result  # three steps: one sum each, the first also gathers its rows
            assert result["anomalies"] == [guard_workers.MISTAKE_AT]
            per_step = result["per_step"]
            removed = guard_workers.COUNTED_STEPS + 1  # remove() tells the others in one sum
            assert sorted(per_step) == list(range(1, removed + 1))
            assert [name for name, _ in per_step[removed]] == ["all_reduce"]
            for step, collectives in per_step.items():
                names = [name for name, _ in collectives]
                failing = step == guard_workers.MISTAKE_AT
                assert names[0] == "all_reduce" and len(names) == (2 if failing else 1), (step, collectives)
                if failing:
                    assert names[1] in ("all_gather_into_tensor", "all_gather_single")
            sizes.setdefault(world_size, set()).update(
                size
                for step, collectives in per_step.items()
                for name, size in collectives
                if name == "all_reduce"
            )
    assert len(sizes[2]) == 1 and sizes[2] == sizes[4], sizes  # the same bytes per rank at 2 and 4 ranks


def test_on_four_ranks_a_repeating_mistake_is_one_line_a_step_from_rank_0_then_folded(tmp_path):
    out = tmp_path / "four"
    results = run_ranks(
        guard_workers.train, 4, (str(out), "fsdp2", (3, 4, 5, 6, 7), {"num_steps": 8}), timeout_s=180
    )
    lines = results[0]["warnings"]
    assert len(lines) == 3, lines
    assert lines[0].startswith("gradaudit guard: step 3: GA201") and "its dump: gradaudit check" in lines[0]
    codes = ", ".join(results[0]["anomalies"][0][1])  # GA201 and what follows from it, as one set
    assert "GA201" in codes
    assert lines[1] == f"gradaudit guard: {codes} again at steps 5-7"  # step 4 is captured in full
    assert lines[2].startswith(f"gradaudit guard: 4 anomalous steps of 7 checked: {codes} at steps 3, 5-7")
    for result in results[1:]:
        assert result["warnings"] == []  # the other ranks log the same lines at debug level
        assert [line for line in result["logged"] if line in lines] == lines
