"""The guard in one line under Accelerate on 2 gloo ranks (DDP, gradient accumulation): the loop's own
`accelerator.clip_grad_norm_` passes every step, a clip on every micro-batch is GA501 at the step it
starts, and the true norm reaches the Accelerator's trackers; in fp16 with Accelerate's GradScaler (set
up as Accelerate does on GPU: it makes none on CPU) the loop passes every step and a torch clip that
skips Accelerate's unscale is GA502. The guard's spike= through accelerate_guard's keywords, and its
replica check of DDP's reduced gradients (GA601)."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from accelerate_guard_workers import MISTAKE_FROM, NUM_STEPS, guarded_accelerate
from guard_spike_replica import SPIKE_STEP, assert_one_spike, assert_replica_fault
from guard_workers import with_trends
from launcher import run_ranks
from reassemble import audit_report, error_codes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("accelerate_guard")
    return out_root, with_trends(
        run_ranks(guarded_accelerate, 2, (str(out_root),), timeout_s=240), str(out_root)
    )


def test_accelerates_own_clip_is_never_flagged_and_its_true_norm_is_logged_through_the_trackers(runs):
    _, results = runs
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
    logged = results[0]["ok"]["logged"]  # accelerator.log reaches the trackers on the main process only
    assert [step for step, _ in logged] == list(range(1, NUM_STEPS + 1))
    for (_, values), returned in zip(logged, results[0]["ok"]["norms"], strict=True):
        assert values["gradaudit/true_norm"] == pytest.approx(returned, rel=1e-5)
        assert values["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
        assert values["gradaudit/anomaly"] == 0.0
    assert results[1]["ok"]["logged"] == []


def test_a_clip_on_every_micro_batch_is_ga501_from_the_step_it_starts(runs):
    out_root, results = runs
    for result in results:
        anomalies = result["clip_every_microbatch"]["anomalies"]
        assert [step for step, _ in anomalies][:1] == [MISTAKE_FROM]
        assert all("GA501" in codes for _, codes in anomalies)
    # one line for the step, warned by rank 0 (the others log it at debug level)
    said = results[0]["clip_every_microbatch"]["warnings"]
    assert any(f"step {MISTAKE_FROM}: " in w and "GA501" in w for w in said)
    # the guard's dump of that step: `gradaudit check` gives the codes the guard named
    (codes,) = {
        tuple(c) for step, c in results[0]["clip_every_microbatch"]["anomalies"] if step == MISTAKE_FROM
    }
    assert error_codes(audit_report(out_root / "clip_every_microbatch" / f"step_{MISTAKE_FROM}")) == set(
        codes
    )
    # the trackers get every checked step at its number, the anomaly at its step, nothing for the step
    # captured in full after it
    run = results[0]["clip_every_microbatch"]
    trend = {line["step"]: line for line in run["trend"]}
    logged = dict(run["logged"])
    assert sorted(logged) == sorted(trend) == [s for s in range(1, NUM_STEPS + 1) if s != MISTAKE_FROM + 1]
    for step, values in logged.items():
        assert values["gradaudit/anomaly"] == len(trend[step]["codes"]) == (step == MISTAKE_FROM)
        assert values["gradaudit/true_norm"] == pytest.approx(trend[step]["true_norm"], rel=1e-9)
    # the ratio is of the last clip call's norm (accelerator.clip_grad_norm_ of the accumulated gradient)
    # to the true norm before the first (the first micro-batch's gradient alone, which that call
    # clipped); here the two are close (0.98), so gradaudit/anomaly is what shows the step
    ratio = logged[MISTAKE_FROM]["gradaudit/reported_over_true"]
    assert ratio == pytest.approx(run["norms"][MISTAKE_FROM - 1] / trend[MISTAKE_FROM]["true_norm"], rel=1e-6)
    assert trend[MISTAKE_FROM]["reported_norm"] == pytest.approx(trend[MISTAKE_FROM]["true_norm"], rel=1e-5)


def test_fp16_with_accelerates_grad_scaler_is_never_flagged_and_its_skipped_step_is_written_as_skipped(runs):
    _, results = runs
    for result in results:
        run = result["fp16_ok"]
        assert run["anomalies"] == [] and run["warnings"] == []
        # the default scale 2**16 overflows the first step (the scaler skips it), then halves
        assert run["scales"] == [2.0**16, 2.0**15, 2.0**15, 2.0**15]
        assert [line["verdict"] for line in run["trend"]] == ["skipped", "ok", "ok", "ok"]
        for line, returned in zip(run["trend"][1:], run["norms"][1:], strict=True):
            assert line["true_norm"] == pytest.approx(
                returned, rel=1e-5
            )  # unscaled, as Accelerate's clip saw
            assert line["min_coef"] == pytest.approx(line["expected_coef"], rel=1e-4)


def test_fp16_clipped_with_torchs_clip_grad_norm_skipping_accelerates_unscale_is_ga502_at_its_step(runs):
    from gradaudit.audit import AuditOptions, audit_folder

    out_root, results = runs
    for result in results:
        run = result["fp16_torch_clip"]
        assert [step for step, _ in run["anomalies"]] == [MISTAKE_FROM]
        assert "GA502" in run["anomalies"][0][1]
    said = results[0]["fp16_torch_clip"]["warnings"]
    assert any(f"step {MISTAKE_FROM}: " in w and "GA502" in w for w in said)
    report = audit_folder(out_root / "fp16_torch_clip" / f"step_{MISTAKE_FROM}", AuditOptions())
    assert "GA502" in {f.code for f in report.findings}


def test_a_spike_passed_through_accelerate_guard_is_marked_named_by_its_parameters_and_dumped(runs, cli):
    """One step's targets scaled by 100; its shares are those of the gradients DDP reduced."""
    out_root, results = runs
    spike = [result["spike"] for result in results]
    assert_one_spike(spike, spike[0]["sums"], out_root / "spike" / f"step_{SPIKE_STEP}", cli)


def test_a_flipped_bit_in_one_ranks_reduced_gradient_is_ga601_at_its_step(runs):
    _, results = runs
    assert_replica_fault([result["replica_flip"] for result in results], (0, 1))
