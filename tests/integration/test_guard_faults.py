"""The guard never harms the run it watches: one fault on one rank at one step (a raise in each part of
the guard, a full disk, an unwritable or reused out_dir, a raising callback, a skipped optimizer step,
SIGTERM while it writes) leaves every rank finishing in bounded time with the weights the run has
without the guard, and the steps around the fault with the verdicts they get without the fault."""

from __future__ import annotations

import os

import guard_fault_workers as workers
import pytest
from launcher import run_ranks

from gradaudit.testing import launch

pytestmark = pytest.mark.integration

WORLD_SIZE = 2
FAULTS = (
    "raise_measure",
    "raise_pack",
    "raise_judge",
    "raise_send",
    "raise_read",
    "raise_dump",
    "raise_capture",
    "raise_on_verdict",
    "full_disk_trend",
    "full_disk_dump",
    "out_dir_under_a_file",
    "existing_dump",
    "skipped_step",
    "pause_alone",
    "remove_alone",
)
LEFT_UNCHECKED = {
    "raise_measure": {3},
    "raise_pack": {3},
    "full_disk_trend": {3, 4},
    "skipped_step": {3},
    "pause_alone": {3, 4},
}
"""Steps a fault leaves out of the trend; every other step keeps its verdict."""
GUARD_OFF_AFTER = {"raise_send": 2, "raise_read": 3, "remove_alone": 2}
"""Faults that break a rank's channel: the trend ends at this step, every rank's guard off after it."""


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    results = run_ranks(workers.faults, WORLD_SIZE, (str(out), request.param, FAULTS), timeout_s=600)
    return request.param, out, results


@pytest.mark.parametrize("fault", FAULTS)
def test_a_fault_on_one_rank_leaves_the_weights_and_the_other_verdicts_as_they_are(runs, fault):
    _, _, results = runs
    baseline = "unguarded_skip" if fault == "skipped_step" else "unguarded"
    clean = results[0]["clean"]
    for rank, result in enumerate(results):
        run = result[fault]
        assert run["digest"] == result[baseline]["digest"], f"rank {rank}'s weights changed"
        assert run["elapsed"] < result["clean"]["elapsed"] + 4 * workers.WAIT_S + 10, f"rank {rank} waited"
        found = {s for s, _ in run["anomalies"]}
        assert found <= {s for s, _ in result["clean"]["anomalies"]}, f"rank {rank}: a false finding"
    trend = results[0][fault]["trend"]
    if fault == "out_dir_under_a_file":
        assert trend == []
    elif fault in GUARD_OFF_AFTER:
        assert trend == [t for t in clean["trend"] if t[0] <= GUARD_OFF_AFTER[fault]]
    else:
        assert trend == [t for t in clean["trend"] if t[0] not in LEFT_UNCHECKED.get(fault, ())]
    if fault not in GUARD_OFF_AFTER:  # the wrong step is still named on every rank
        for result in results:
            assert result[fault]["anomalies"] == result["clean"]["anomalies"] != []


def test_the_clean_guarded_run_names_the_wrong_step_only(runs):
    _, _, results = runs
    for result in results:
        assert [s for s, _ in result["clean"]["anomalies"]] == [workers.MISTAKE_AT]
        assert [w for w in result["clean"]["warnings"] if "is off" in w or "could not" in w] == []


def test_what_the_guard_says_of_each_fault(runs):
    _, out, results = runs
    said = [[" ".join(r[fault]["warnings"]) for r in results] for fault in FAULTS]
    by_fault = dict(zip(FAULTS, said, strict=True))
    assert "could not measure step 3" in by_fault["raise_measure"][1]
    assert "step 3 is not checked" in by_fault["raise_measure"][0]
    assert "on_verdict raised" in by_fault["raise_on_verdict"][1]
    assert "the user's logger failed" in by_fault["raise_on_verdict"][1]  # its traceback
    assert "cannot write the trend to" in by_fault["full_disk_trend"][0]
    assert "guard_trend.jsonl" in by_fault["full_disk_trend"][0]
    assert "cannot write the dump of step 6" in by_fault["full_disk_dump"][1]
    assert results[1]["full_disk_dump"]["dumps"] == [] and results[0]["full_disk_dump"]["dumps"] != []
    assert "rank(s) did not send their numbers of step 3" in by_fault["raise_send"][0]
    assert "rank(s) [1] removed or switched off their guard at step 3" in by_fault["remove_alone"][0]
    assert "rank(s) [1] skipped optimizer step 3" in by_fault["skipped_step"][0]
    assert "skipped optimizer step 3" not in by_fault["skipped_step"][1]  # rank 0 warns what all concluded
    assert any(
        "rank(s) [1] skipped optimizer step 3" in line for line in results[1]["skipped_step"]["logged"]
    )
    for rank in (0, 1):
        assert results[rank]["skipped_step"]["skipped_steps"] == [(3, [1])]
    # a restart into a folder holding an earlier attempt's dump writes beside it
    for result in results:
        assert [os.path.relpath(d, out / "existing_dump") for d in result["existing_dump"]["dumps"]] == [
            os.path.join(
                "attempt_2", f"step_{workers.MISTAKE_AT}", f"rank_0000{results.index(result)}.safetensors"
            )
        ]


def test_replica_weights_that_differ_after_a_skipped_step_are_said_to_differ_for_that_reason(runs):
    stack, _, results = runs
    if stack != "ddp":
        pytest.skip("FSDP2 over 2 ranks holds no replicated weights")
    for result in results:
        run = result["skipped_step_weighed"]
        assert run["digest"] == result["unguarded_skip"]["digest"]
        # the first weight check after the skip, and each later one: the weights stay apart
        assert next(s for s, c in run["anomalies"] if "GA605" in c) == 4, run["anomalies"]
    found = [w for w in results[0]["skipped_step_weighed"]["warnings"] if "GA605 the weights" in w]
    assert found and all(
        "GA605 the weights of ranks 0-1 over group 'world' differ" in w
        and "since rank(s) [1] skipped optimizer step 3, as the guard said then" in w
        and "rank-local fault" not in w
        for w in found
    ), found


def test_sigterm_while_a_rank_writes_a_dump_passes_through_and_leaves_no_partial_file(tmp_path):
    outcomes = launch(
        workers.terminated_while_dumping, WORLD_SIZE, (str(tmp_path),), timeout_s=120, start_method="spawn"
    )
    assert [o.status for o in outcomes] == ["ok", "ok"]  # no rank hung
    assert outcomes[1].value["ended"] == "preempted"  # the guard did not swallow the handler's exception
    step_dir = tmp_path / f"step_{workers.MISTAKE_AT}"
    names = sorted(p.name for p in step_dir.iterdir()) if step_dir.is_dir() else []
    assert "rank_00001.safetensors" not in names
    assert not [n for n in names if ".tmp-" in n]


def test_a_block_unfrozen_under_ddp_is_named_as_replicas_that_differ_since_ddp_never_reduces_it(tmp_path):
    results = run_ranks(workers.changes, WORLD_SIZE, (str(tmp_path), "ddp_unfreeze"), timeout_s=180)
    for result in results:
        assert result["anomalies"][0] == (5, ["GA301", "GA601"])  # true: each rank's head gradient is its own


@pytest.mark.parametrize("stack", ["ddp", "fsdp2"])
def test_a_block_unfrozen_and_added_mid_run_and_a_reloaded_state_give_no_false_finding(tmp_path, stack):
    results = run_ranks(workers.changes, WORLD_SIZE, (str(tmp_path), stack), timeout_s=180)
    for result in results:
        assert result["anomalies"] == []
    assert any("ownership is inferred again" in w for w in results[0]["warnings"])
    assert any("ownership is inferred again" in line for line in results[1]["logged"])
    steps = [s for s, _ in results[0]["trend"]]
    assert steps == [s for s in range(1, 15) if s != 4]  # the step whose parameters changed is not judged
