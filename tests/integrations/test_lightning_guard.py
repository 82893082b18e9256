"""The guard as one Lightning callback on 2 gloo ranks: Lightning's own clip passes every step, and a
user's own clip in `on_after_backward` (each micro-batch) is GA501 from the first step; the same in
16-mixed with a GradScaler, where the hook's clip is also GA502. What the loggers get, read back from
Lightning's CSVLogger: each logged step's own values at the guard's step number, an anomaly at its step
whatever the logging interval, nothing for the step captured in full. The guard's spike= through the
callback's keywords, and its replica check of DDP's reduced gradients (GA601)."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("lightning")

from guard_spike_replica import SPIKE_STEP, assert_one_spike, assert_replica_fault
from guard_workers import with_trends
from launcher import run_ranks
from lightning_guard_workers import (
    CSV_LOG_EVERY,
    CSV_STEPS,
    LATE_LOG_EVERY,
    NUM_STEPS,
    THRICE_AT,
    guarded_fit,
)
from reassemble import audit_report, error_codes

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("lightning_guard")
    return out_root, with_trends(run_ranks(guarded_fit, 2, (str(out_root),), timeout_s=300), str(out_root))


def test_a_clip_per_micro_batch_in_a_hook_is_caught_and_lightnings_own_clip_passes(runs):
    tmp_path, results = runs
    for result in results:
        assert result["ok"]["anomalies"] == [] and result["ok"]["warnings"] == []
        assert [step for step, _ in result["hook_clip"]["anomalies"]][:1] == [1]
        assert all("GA501" in codes for _, codes in result["hook_clip"]["anomalies"])
    # the guard's dump of step 1: `gradaudit check` gives the code the guard named
    (codes,) = {tuple(codes) for step, codes in results[0]["hook_clip"]["anomalies"] if step == 1}
    assert error_codes(audit_report(tmp_path / "hook_clip" / "step_1")) == set(codes)
    # the true norm is logged beside Lightning's own metrics, and matches what the clip reported
    logged = results[0]["ok"]["logged"]
    assert logged["gradaudit/true_norm"] > 0
    assert logged["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
    trend = (tmp_path / "ok" / "guard_trend.jsonl").read_text().splitlines()
    assert len(trend) == NUM_STEPS


def test_16_mixed_with_its_grad_scaler_passes_lightnings_clip_and_catches_a_hooks_clip_of_scaled_gradients(
    runs,
):
    """Lightning's own 16-mixed plugin with a CPU GradScaler (precision="16-mixed" is bf16 on CPU)."""
    _, results = runs
    for result in results:
        ok, wrong = result["fp16_ok"], result["fp16_hook_clip"]
        assert ok["scaler"] and ok["anomalies"] == [] and ok["warnings"] == []
        # the default scale 2**16 overflows the first step: the scaler skips it, the guard writes it so
        assert [line["verdict"] for line in ok["trend"]] == ["skipped", "ok", "ok"]
        assert ok["logged"]["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
        # the hook clips each micro-batch before Lightning unscales: from the first step not skipped
        assert wrong["anomalies"] == [(2, ["GA501", "GA502"])]
        assert [line["verdict"] for line in wrong["trend"]] == ["skipped", "anomaly"]


def test_read_one_step_late_as_on_gpu_each_step_logged_carries_its_own_true_norm(runs):
    _, results = runs
    late = results[0]["late"]
    assert late["anomalies"] == [] and late["warnings"] == []
    trend = {line["step"]: line["true_norm"] for line in late["trend"]}
    assert sorted(trend) == list(range(1, NUM_STEPS + 1))
    # Lightning logs step 2 (log_every_n_steps=2): its own number, read at that log step, not step 1's
    assert [(step, values["gradaudit/true_norm"]) for step, values in late["logger"]] == [
        (LATE_LOG_EVERY, pytest.approx(trend[LATE_LOG_EVERY], rel=1e-6))
    ]


def csv_rows(path) -> dict[int, dict[str, float]]:
    """The gradaudit columns of a CSVLogger's metrics.csv, by the step of their row."""
    with open(path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    logged: dict[int, dict[str, float]] = {}
    for row in rows:
        values = {k: float(v) for k, v in row.items() if k.startswith("gradaudit/") and v != ""}
        if values:
            assert int(row["step"]) not in logged, f"step {row['step']} logged twice"
            logged[int(row["step"])] = values
    return logged


@pytest.mark.parametrize(
    ("name", "full", "logged_steps"), [("csv", 4, [2, 3, 6]), ("csv_late", 5, [2, 3, 4, 6])]
)
def test_the_csv_logger_gets_each_steps_own_values_at_its_step_and_a_triple_clip_in_its_ratio_and_anomaly(
    runs, name, full, logged_steps
):
    """Lightning logs every 2nd step; step 3 clips three times (GA501: logged although Lightning does not
    log step 3; in csv_late, as on GPU, once its verdict is read at step 4). The step captured in full
    after it logs nothing: step 4, a step Lightning logs; read one step late, step 5."""
    _, results = runs
    run = results[0][name]
    assert [(step, codes) for step, codes in run["anomalies"]] == [(THRICE_AT, ["GA501"])]
    trend = {line["step"]: line for line in run["trend"]}
    assert sorted(trend) == [s for s in range(1, CSV_STEPS + 1) if s != full]
    logged = csv_rows(run["csv"])
    assert [s for s in range(1, CSV_STEPS + 1) if s % CSV_LOG_EVERY == 0] == [2, 4, 6]
    assert sorted(logged) == logged_steps
    for step, values in logged.items():
        assert values["gradaudit/true_norm"] == pytest.approx(trend[step]["true_norm"], rel=1e-6)
        assert values["gradaudit/anomaly"] == len(trend[step]["codes"])
    assert logged[2]["gradaudit/reported_over_true"] == pytest.approx(1.0, rel=1e-5)
    assert logged[6]["gradaudit/anomaly"] == 0.0
    # the triple clip: the first call reported the true norm (the trend's pair: ratio 1); the last, the
    # norm of the gradient the first had clipped already, logged over the true norm
    first, _, last = run["thrice"]
    assert trend[THRICE_AT]["reported_norm"] == pytest.approx(first, rel=1e-6)
    assert first == pytest.approx(trend[THRICE_AT]["true_norm"], rel=1e-5)
    assert logged[THRICE_AT]["gradaudit/anomaly"] == 1.0
    ratio = logged[THRICE_AT]["gradaudit/reported_over_true"]
    assert ratio == pytest.approx(last / first, rel=1e-5) and ratio < 0.5


def test_a_spike_passed_through_the_callback_is_marked_named_by_its_parameters_and_dumped(runs, cli):
    """One step's targets scaled by 100; its shares are those of the gradients DDP reduced."""
    out_root, results = runs
    spike = [result["spike"] for result in results]
    assert_one_spike(spike, spike[0]["sums"], out_root / "spike" / f"step_{SPIKE_STEP}", cli)


def test_a_flipped_bit_in_one_ranks_reduced_gradient_is_ga601_at_its_step(runs):
    _, results = runs
    assert_replica_fault([result["replica_flip"] for result in results], (0, 1))
