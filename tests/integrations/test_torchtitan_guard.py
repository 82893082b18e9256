"""The guard in one line beside torchtitan's clip_grad_norm_ on 4 gloo ranks (2 pipeline stages x 2
FSDP2 ranks): the norm reduced over the pp mesh passes every step, and leaving the pp mesh out is
named at the step it happens, with the code `gradaudit check` gives for the guard's dump. The anomaly
count, true norm and reported/true of each step torchtitan logs are in its TensorBoard events beside its
grad_norm, and those of an anomaly torchtitan does not log at its own step, read back with tensorboard's
own reader (the ok run reads its verdicts one step late, as on GPU: those of the steps torchtitan logs
are read at its log call). The guard's spike= through TorchtitanGuard's keywords on the pp stages, and
its replica check (GA601) of HSDP's reduced gradients."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.distributed.utils")

from guard_spike_replica import SPIKE_STEP, assert_one_spike, assert_replica_fault
from guard_workers import with_trends
from launcher import run_ranks
from reassemble import audit_report, error_codes
from torchtitan_guard_workers import FLIP_RANK, LOG_FREQ, MISTAKE_AT, NUM_STEPS, guarded_torchtitan

pytestmark = pytest.mark.integration

LOGGED = [step for step in range(1, NUM_STEPS + 1) if step == 1 or step % LOG_FREQ == 0]
METRICS_RANK = 2
"""The rank torchtitan's MetricsProcessor logs from under pp: the first of the last stage."""


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one TensorBoard run under folder, as (step, value) per tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = folder.glob("tb/*/events.out.tfevents.*")
    accumulator = EventAccumulator(str(events.parent))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("torchtitan_guard")
    return out_root, with_trends(
        run_ranks(guarded_torchtitan, 4, (str(out_root),), timeout_s=300), str(out_root)
    )


@pytest.mark.parametrize("name", ["ok", "no_metrics"])
def test_torchtitans_clip_reduced_over_the_pp_mesh_is_never_flagged(runs, name):
    _, results = runs
    for result in results:
        run = result[name]
        assert run["anomalies"] == [] and run["warnings"] == [] and run["log_restored"]
        assert run["true_norms"][0] == pytest.approx(run["norms"][-1], rel=1e-5)
        # on_verdict= gets every checked step's line, on every rank
        verdicts = run["verdicts"]
        assert [step for step, _ in verdicts] == list(range(1, NUM_STEPS + 1))
        for (_, values), returned in zip(verdicts, run["norms"], strict=True):
            assert values["gradaudit/true_norm"] == pytest.approx(returned, rel=1e-5)
            assert values["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
            assert values["gradaudit/anomaly"] == 0.0


def test_leaving_out_the_pp_mesh_is_named_at_its_step_with_the_code_check_gives(runs):
    out_root, results = runs
    for result in results:
        anomalies = result["stage_norm"]["anomalies"]
        assert [step for step, _ in anomalies][:1] == [MISTAKE_AT]
        assert "GA203" in anomalies[0][1]
    assert "GA203" in error_codes(audit_report(out_root / "stage_norm" / f"step_{MISTAKE_AT}"))


@pytest.mark.parametrize(("name", "guard_steps"), [("ok", LOGGED), ("stage_norm", [*LOGGED, NUM_STEPS])])
def test_the_values_are_in_torchtitans_tensorboard_steps_beside_its_grad_norm_and_each_anomaly_at_its_step(
    runs, name, guard_steps
):
    """torchtitan logs steps 1 and 3; stage_norm's step 4 is captured in full after step 3's anomaly (not
    checked, and not logged), its step 5 an anomaly torchtitan does not log: logged at its own step."""
    out_root, results = runs
    assert LOGGED == [1, MISTAKE_AT]
    scalars = tensorboard_scalars(out_root / f"{name}_metrics")  # one run: the metrics rank's
    lines, norms = dict(results[METRICS_RANK][name]["verdicts"]), results[METRICS_RANK][name]["norms"]
    true_norms, ratios = scalars["gradaudit/true_norm"], scalars["gradaudit/reported_over_true"]
    anomalies = scalars["gradaudit/anomaly"]
    # the steps torchtitan logs (log_freq), each with its own step's values, none for another step
    assert [step for step, _ in scalars["grad_norm"]] == LOGGED
    assert [step for step, _ in true_norms] == [step for step, _ in ratios] == guard_steps
    assert [step for step, _ in anomalies] == guard_steps
    assert [value for _, value in scalars["grad_norm"]] == pytest.approx(
        [norms[step - 1] for step in LOGGED], rel=1e-6
    )
    assert [value for _, value in true_norms] == pytest.approx(
        [lines[step]["gradaudit/true_norm"] for step in guard_steps], rel=1e-6
    )
    assert [value for _, value in anomalies] == [lines[step]["gradaudit/anomaly"] for step in guard_steps]
    # beside torchtitan's grad_norm, of that grad_norm (this rank's); alone, the guard's own
    assert [value for _, value in ratios] == pytest.approx(
        [norms[step - 1] / lines[step]["gradaudit/true_norm"] for step in LOGGED]
        + [lines[step]["gradaudit/reported_over_true"] for step in guard_steps[len(LOGGED) :]],
        rel=1e-6,
    )
    # 1 while the norm is reduced over the pp mesh; this stage's norm only, below 1, where it is not
    assert ratios[0][1] == pytest.approx(1.0, rel=1e-5) and anomalies[0][1] == 0.0
    if name == "ok":
        assert ratios[1][1] == pytest.approx(1.0, rel=1e-5) and anomalies[1][1] == 0.0
    else:
        assert all(ratio < 0.9 for _, ratio in ratios[1:]) and all(value >= 1 for _, value in anomalies[1:])


def test_a_spike_passed_through_torchtitan_guard_is_marked_and_named_across_the_pp_stages(runs, cli):
    """One step's targets scaled by 100; the parameters named are of both stages (ranks 0-1 hold the
    first, ranks 2-3 the last), their shares those of the full gradients."""
    out_root, results = runs
    spike = [result["spike"] for result in results]
    sums = {**spike[0]["sums"], **spike[METRICS_RANK]["sums"]}
    assert set(sums) == {f"{m}.{p}" for m in ("fc1", "fc2", "norm", "head") for p in ("weight", "bias")}
    assert_one_spike(spike, sums, out_root / "spike" / f"step_{SPIKE_STEP}", cli)


def test_a_flipped_bit_in_one_hsdp_replicas_reduced_gradient_is_ga601_at_its_step(runs):
    """HSDP over 2 replicas x 2 FSDP2 ranks: rank 3's shard has one copy elsewhere, rank 1's."""
    _, results = runs
    assert FLIP_RANK == 3
    assert_replica_fault([result["hsdp_flip"] for result in results], (1, 3))
