"""A parameter whose ownership the capture cannot infer is listed as not captured, so the report names
it under GA104 instead of leaving it out silently (issue 12 item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradaudit
from gradaudit.audit import audit_step_dir
from gradaudit.capture.warn import CaptureWarning, forget_warnings
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import load_step
from gradaudit.errors import CaptureError

from .cli import run_cli

MAX_NORM = 0.5


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    forget_warnings()


def _model_with_a_tensor_parallel_weight() -> torch.nn.Module:
    """A Megatron-style column-parallel weight (marked tensor_model_parallel) next to a plain layer: without
    groups={'tp': ...} the capture cannot place the weight's rows in the global parameter."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].weight.tensor_model_parallel = True
    model[0].weight.partition_dim = 0
    return model


def _one_step(model: torch.nn.Module, out_dir: Path) -> Path:
    with pytest.warns(CaptureWarning, match=r"leaves out parameter '0\.weight'.*tensor-parallel group"):
        with gradaudit.audit_step(model, out_dir, step=3, max_norm=MAX_NORM) as audit:
            model(torch.ones(5, 4)).square().sum().backward()
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    assert audit.path is not None
    return audit.path.parent


def test_a_parameter_whose_ownership_is_not_inferred_is_recorded_as_not_captured_with_its_reason(tmp_path):
    step_dir = _one_step(_model_with_a_tensor_parallel_weight(), tmp_path)
    step = load_step(step_dir)
    (left_out,) = step.ranks[0].not_captured
    assert left_out.name == "0.weight"
    assert left_out.reason.startswith("ownership not inferred: ") and "groups={'tp'" in left_out.reason
    assert "0.weight" not in step.params and {"0.bias", "1.weight", "1.bias"} <= set(step.params)


def test_the_report_lists_a_parameter_inference_refused_under_ga104_not_checked(tmp_path, capsys):
    step_dir = _one_step(_model_with_a_tensor_parallel_weight(), tmp_path)
    report = audit_step_dir(step_dir, AuditOptions())
    reason = {n.code: n.reason for n in report.not_checked}["GA104"]
    assert "0.weight on rank 0: ownership not inferred" in reason
    outcome = run_cli(capsys, "check", str(step_dir), "--format", "markdown")
    assert "GA104" in outcome.stdout and "0.weight" in outcome.stdout


def test_strict_mode_refuses_a_parameter_whose_ownership_is_not_inferred(tmp_path):
    model = _model_with_a_tensor_parallel_weight()
    with pytest.raises(CaptureError, match=r"cannot capture '0\.weight'"):
        with gradaudit.audit_step(model, tmp_path, step=3, max_norm=MAX_NORM, strict=True):
            pass
    assert not list(Path(tmp_path).rglob("*.safetensors"))
