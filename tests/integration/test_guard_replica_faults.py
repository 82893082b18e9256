"""A flipped bit in one rank's gradient copy, after the reduction that makes every replica's bytes equal,
is named by the guard at its step as a rank-local fault with that rank, its host and device, under DDP,
HSDP's replicate dimension and a tensor-parallel-replicated LayerNorm, and `gradaudit check` of the
step's dump names the parameter and the rank; a flipped bit in one replica's weights is named at the
next comparison of the weights, or at the next step the guard dumps; correct runs of the same stacks
give no replica finding (the stacks' correct runs in every dtype: test_guard_stacks.py)."""

from __future__ import annotations

import json
import socket

import pytest
import replica_fault_workers as workers
from launcher import run_ranks

from gradaudit.ranksets import compact_ranks

pytestmark = pytest.mark.integration

CASES = {  # stack -> (world size, the rank whose copy is flipped, the ranks holding that copy)
    "ddp": (4, 1, (0, 1, 2, 3)),
    "hsdp": (4, 3, (1, 3)),
    "tp": (2, 1, (0, 1)),
}


@pytest.mark.parametrize("stack", sorted(CASES))
def test_a_flipped_bit_in_one_replica_is_a_rank_local_fault_named_at_its_step(tmp_path, stack, cli):
    world_size, flip_rank, holders = CASES[stack]
    results = run_ranks(workers.train, world_size, (str(tmp_path), stack, flip_rank), timeout_s=300)
    for result in results:
        steps = dict(result["anomalies"])
        assert "GA601" in steps.get(workers.FLIP_STEP, []), result["anomalies"]
        assert min(steps) == workers.FLIP_STEP  # nothing before the flip
    said = " ".join(results[0]["warnings"])
    assert f"step {workers.FLIP_STEP}: " in said
    if len(holders) > 2:  # a majority agrees: the odd copy is named, with its host and device
        assert f"rank {flip_rank} (host {socket.gethostname()}, device cpu) holds a gradient copy" in said
        assert "a rank-local fault, not the clipping code" in said
        assert "re-run the step on it, and drain the node if it repeats" in said
    else:  # two copies: either may be the faulty one
        assert f"ranks {compact_ranks(holders)} hold copies over group" in said
    # the dump of the step holds the parameters' pieces: `gradaudit check` names the flipped one
    flipped = results[0]["flipped"].removeprefix("module.")  # DDP's wrapper is not in the names
    code, out, _ = cli("check", str(tmp_path / f"step_{workers.FLIP_STEP}"), "--format", "json")
    report = json.loads(out)
    (ga601,) = [f for f in report["findings"] if f["code"] == "GA601"]
    assert ga601["params"] == [flipped], ga601
    assert ga601["ranks"] == [[flip_rank, flip_rank]], ga601  # runs of ranks
    assert f"{flipped}: rank {flip_rank} differ" in ga601["message"]
    assert "head.weight" not in ga601["message"] and code != 0
    assert any("guard-triggered" in w and "ownership group" not in w for w in report["warnings"])


def test_a_correct_run_gives_no_replica_finding(tmp_path):
    results = run_ranks(workers.train, 4, (str(tmp_path), "ddp", None), timeout_s=300)
    for result in results:
        assert result["anomalies"] == []


def test_a_flipped_bit_in_one_replicas_weights_is_named_at_the_next_weight_check(tmp_path):
    """Flipped after the optimizer step of step 6; the weights are compared every 4 steps: named at 8,
    with the step they last agreed at, and the gradients (all-reduced alike) never differ."""
    results = run_ranks(workers.train, 4, (str(tmp_path), "ddp", 1, True), timeout_s=300)
    for result in results:
        steps = dict(result["anomalies"])
        assert min(steps) == 8 and steps[8] == ["GA605"], result["anomalies"]
        assert all("GA601" not in codes for codes in steps.values())
    said = " ".join(results[0]["warnings"])
    assert f"the weights of rank 1 (host {socket.gethostname()}, device cpu) over group" in said
    assert "first seen at step 8, they last agreed at step 4" in said


def test_a_flipped_bit_in_one_replicas_weights_is_named_at_the_next_step_the_guard_dumps(tmp_path):
    """Flipped after the optimizer step of step 6, the weights compared every 10 steps: a clip call that
    leaves a parameter out at step 7 makes the guard gather its rows, and the weights after its
    optimizer step are compared with them: GA605 at step 7, beside the clipping's own finding."""
    results = run_ranks(
        workers.train,
        4,
        (str(tmp_path), "ddp", 1, True, 10, True),
        timeout_s=300,
    )
    for result in results:
        steps = dict(result["anomalies"])
        assert min(steps) == workers.WRONG_CLIP_STEP, result["anomalies"]
        assert "GA605" in steps[workers.WRONG_CLIP_STEP] and len(steps[workers.WRONG_CLIP_STEP]) > 1
        assert all("GA601" not in codes for codes in steps.values())
    said = " ".join(results[0]["warnings"])
    assert f"the weights of rank 1 (host {socket.gethostname()}, device cpu) over group" in said
    assert f"first seen at step {workers.WRONG_CLIP_STEP}, they last agreed at step 1" in said


def test_a_steps_weights_are_compared_only_when_every_replica_sent_them_after_the_same_update():
    """A rank that reads a step's verdict only after the next optimizer step (its wait ran out) sends no
    weights: that step's weights are not compared, rather than compared across two optimizer steps; nor
    are they when the ranks clipped differently at the step (their weights then differ by its update),
    or after a step some ranks skipped, until the next weight check."""
    import numpy as np

    from gradaudit.live.analysis_input import OwnershipGroup
    from gradaudit.live.guard import Guard
    from gradaudit.live.summary import OK, VectorLayout

    guard = object.__new__(Guard)
    guard.every, guard.weights_every = 1, 10
    guard.groups = (OwnershipGroup(name="dp", replica_group="dp"),)
    guard._held = [(True,), (True,), (True,)]
    guard._faults, guard.skipped_steps = (), []
    guard.layout = VectorLayout(num_groups=1)
    rows = np.full((3, guard.layout.size), np.nan)
    call = guard.layout.call_offset(0)
    rows[:, :3] = (OK, 1.0, 0.25)  # measured, one clip call, its applied coefficient
    rows[:, call : call + 3] = (4.0, 1.0, 2.0)  # reported norm, max_norm, norm_type
    at = guard.layout.weights_offset
    rows[:, at] = [4.0, 4.0, 5.0]
    assert guard._weights_held(rows, 7) == guard._held
    rows[1, call + 1] = 0.5  # rank 1 clipped to another max_norm
    assert guard._weights_held(rows, 7) is None
    rows[1, call + 1] = 1.0
    rows[2, at] = np.nan
    assert guard._weights_held(rows, 7) is None
    assert guard._weights_held(rows, 10) == guard._held  # a weight check's step: every rank measured
    rows[2, at] = 5.0
    guard.skipped_steps = [(3, (1,))]  # rank 1 skipped step 3: its weights differ until the next check
    assert guard._weights_held(rows, 7) is None
    assert guard._weights_held(rows, 13) == guard._held
