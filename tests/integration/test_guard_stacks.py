"""gradaudit.guard on every stack the issue names beside DDP and FSDP2 (tested in test_guard.py) and on
pipeline stages sharded with FSDP2, in float32, bfloat16 and float16 with a GradScaler (DDP, FSDP1, FSDP2, HSDP,
TP, FSDP2+TP, pipeline, pipeline+FSDP2, MoE), on real gloo ranks: a correct run of 20 steps is never flagged
and its trend's true norm is what the stack's clip returned; one known mistake per stack is named at the
step it is first made, with the code `gradaudit check` gives for the dump the guard wrote.

Two spawns (2 and 4 ranks) run every stack: process start-up dominates the cost of these tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import guard_stack_workers as workers
import pytest
from launcher import run_ranks

from gradaudit.audit import audit_folder
from gradaudit.checks.base import AuditOptions
from gradaudit.norms import NORM_RTOL_BY_DTYPE

pytestmark = pytest.mark.integration

STACKS_OF_TWO = {  # stack -> (the dtype of its gradients, the code of its mistake)
    "fsdp1": ("float32", "GA201"),
    "fsdp1_bf16": ("bfloat16", "GA201"),
    "fsdp1_fp16": ("float32", "GA502"),
    "tp": ("float32", "GA202"),
    "tp_bf16": ("bfloat16", None),
    "tp_fp16": ("float32", "GA502"),
    "pp": ("float32", "GA201"),
    "pp_bf16": ("bfloat16", None),
    "pp_fp16": ("float32", "GA502"),
    "fsdp2_bf16": ("bfloat16", "GA201"),
    "ddp_fp16": ("float32", "GA502"),
    "fsdp2_fp16": ("float32", "GA502"),
    "ddp_bf16": ("bfloat16", "GA301"),
}
STACKS_OF_FOUR = {
    "hsdp": ("float32", "GA202"),
    "hsdp_bf16": ("bfloat16", None),
    "hsdp_fp16": ("float32", "GA502"),
    "fsdp2_tp": ("float32", "GA201"),
    "fsdp2_tp_bf16": ("bfloat16", None),
    "fsdp2_tp_fp16": ("float32", "GA502"),
    "moe": ("float32", "GA207"),
    "moe_bf16": ("bfloat16", None),
    "moe_fp16": ("float32", "GA502"),
    "pp_fsdp2": ("float32", "GA203"),
    "pp_fsdp2_bf16": ("bfloat16", None),
    "pp_fsdp2_fp16": ("float32", "GA502"),
}
STACKS = {**STACKS_OF_TWO, **STACKS_OF_FOUR}
MISTAKES = {f"{stack}_mistake": code for stack, (_, code) in STACKS.items() if code is not None}
MISTAKES["ddp_fp16_skip_mistake"] = "GA402"  # one rank's scaler skips the step, the other steps


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("guard_stacks")
    found = {}
    for world_size, fn in ((2, workers.world_of_two), (4, workers.world_of_four)):
        results = run_ranks(fn, world_size, (str(out_root),), timeout_s=300)
        for name in results[0]:
            found[name] = [r[name] for r in results]
    return found


def _trend(result: dict) -> list[dict]:
    path = Path(result["out_dir"]) / "guard_trend.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _errors(report) -> list[str]:
    return sorted({f.code for f in report.findings if f.severity.name == "ERROR"})


@pytest.mark.parametrize("stack", sorted(STACKS))
def test_a_correct_run_is_never_flagged_and_its_true_norm_is_what_the_clip_returned(runs, stack):
    dtype, _ = STACKS[stack]
    results = runs[stack]
    for result in results:
        assert result["anomalies"] == [] and result["warnings"] == [] and result["dumps"] == []
    trend = _trend(results[0])
    assert [line["step"] for line in trend] == list(range(1, workers.NUM_STEPS + 1))
    skipped = {workers.SKIPPED_STEP} if stack.endswith("_fp16") else set()
    for line, returned in zip(trend, results[0]["norms"], strict=True):
        if line["step"] in skipped:  # the scaler found inf gradients and skipped the optimizer step
            assert line["verdict"] == "skipped" and line["codes"] == [] and not math.isfinite(returned)
            continue
        assert line["verdict"] == "ok", line
        assert line["true_norm"] > workers.MAX_NORM  # every step clips
        assert line["true_norm"] == pytest.approx(returned, rel=NORM_RTOL_BY_DTYPE[dtype])


@pytest.mark.parametrize("run", sorted(MISTAKES))
def test_a_mistake_is_named_at_its_step_with_the_code_check_gives_for_the_guards_dump(runs, run):
    code = MISTAKES[run]
    results = runs[run]
    step = workers.MISTAKE_STEP
    for result in results:
        flagged = [at for at, _ in result["anomalies"]]
        # after one rank alone skipped, the DDP replicas differ: the next step is wrong too (GA301)
        assert flagged == [step] or (run == "ddp_fp16_skip_mistake" and flagged[0] == step), flagged
        assert code in result["anomalies"][0][1]
        said = result["warnings"] if result is results[0] else result["logged"]  # rank 0 warns
        assert any(w.startswith(f"gradaudit guard: step {step}: ") and code in w for w in said)
    trend = _trend(results[0])
    assert [line["verdict"] for line in trend][:step] == ["ok"] * (step - 1) + ["anomaly"]
    report = audit_folder(Path(results[0]["out_dir"]) / f"step_{step}", AuditOptions())
    assert _errors(report) == sorted(results[0]["anomalies"][0][1])
    assert any(w.startswith("guard-triggered") for w in report.warnings)
