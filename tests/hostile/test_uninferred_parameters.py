"""A parameter whose ownership the capture cannot infer is listed as not captured, so the report names
it under GA104 and `show` lists it, instead of leaving it out silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gradaudit
from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import load_step
from gradaudit.errors import CaptureError
from gradaudit.render.inventory import MAX_LISTED
from gradaudit.warn import CaptureWarning, forget_warnings

from .cli import run_cli
from .corpus import edit_metadata, rank_path, write_valid_step

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


def test_show_lists_the_parameters_not_captured_with_their_ranks_and_reasons(tmp_path, capsys):
    step_dir = _one_step(_model_with_a_tensor_parallel_weight(), tmp_path)
    outcome = run_cli(capsys, "show", str(step_dir))
    assert outcome.code == 0, outcome.stderr
    lines = outcome.stdout.splitlines()
    heading = lines.index("not captured (1; their gradients are in no norm, GA104):")
    assert lines[heading + 1].startswith("  0.weight on rank 0: ownership not inferred: parameter '0.weight'")
    as_json = json.loads(run_cli(capsys, "show", str(step_dir), "--format", "json").stdout)
    ((entry),) = as_json["not_captured"]
    assert entry["name"] == "0.weight" and entry["ranks"] == [0] and "tensor-parallel" in entry["reason"]


def test_show_names_every_rank_that_left_a_parameter_out_and_caps_the_terminal_list(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    left_out = [{"name": f"emb{i}.weight", "reason": "sparse gradient"} for i in range(MAX_LISTED + 3)]
    for rank in (0, 1):
        edit_metadata(rank_path(step_dir, rank), lambda doc: doc.__setitem__("not_captured", left_out))
    text = run_cli(capsys, "show", str(step_dir)).stdout
    assert "  emb0.weight on ranks 0-1: sparse gradient" in text
    assert "(and 3 more; --format json lists them all)" in text
    as_json = json.loads(run_cli(capsys, "show", str(step_dir), "--format", "json").stdout)
    assert len(as_json["not_captured"]) == MAX_LISTED + 3
    assert as_json["not_captured"][0] == {"name": "emb0.weight", "reason": "sparse gradient", "ranks": [0, 1]}
