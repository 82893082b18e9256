"""The stages of `gradaudit check`, called one by one, give the report the CLI prints: build_report
is complete given what the analysis hands it (the update judgements included: GA603/GA604)."""

from __future__ import annotations

import json

import pytest
import torch
from builders import clip, whole, write_step

from gradaudit.analysis.coverage import coverage_by_param
from gradaudit.audit import analyse, audit_step_dir, build_report, judge_updates
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import TensorReader, load_step
from gradaudit.measure.measure import measure_step
from gradaudit.render.json import report_to_dict

LR = 0.1


def _adam_like_step(directory, ours_after: torch.Tensor, before: torch.Tensor, grad: torch.Tensor):
    return write_step(
        directory,
        world_size=1,
        params={"w": tuple(grad.shape)},
        pieces={0: [whole("w", grad=grad, param_before=before, param_after=ours_after)]},
        clips=clip(max_norm=100.0, reported_norm=float(grad.norm())),
    )


@pytest.fixture
def dumps(tmp_path):
    """A step whose gradients equal the reference's and whose next weights differ by half a step on
    the one element whose gradient is zero: what Adam makes of rounding noise (GA604, not GA603)."""
    grad = torch.tensor([1.0, 0.0, -2.0, 0.5], dtype=torch.float64)
    before = torch.tensor([0.5, -0.25, 1.0, 2.0], dtype=torch.float64)
    after = before - LR * torch.sign(grad)
    ours = after.clone()
    ours[1] += LR / 2
    reference = _adam_like_step(tmp_path / "reference" / "step_1", after, before, grad)
    run = _adam_like_step(tmp_path / "run" / "step_1", ours, before, grad)
    return run, reference


def test_the_stages_called_one_by_one_give_the_report_of_the_whole_audit(dumps):
    run, reference_dir = dumps
    options = AuditOptions(reference=str(reference_dir))
    whole_audit = audit_step_dir(run, options)
    codes = {f.code for f in whole_audit.findings}
    assert "GA604" in codes and "GA603" not in codes, sorted(codes)

    step, reference = load_step(run), load_step(reference_dir)
    with TensorReader(step) as reader:
        measured = measure_step(step, reader, reference=reference)
        judgements = judge_updates(step, reference, measured, reader, options)
    inputs = analyse(step, measured, coverage=coverage_by_param(step), update_judgements=judgements)
    assert set(inputs.update_judgements) == {"w"} and inputs.update_judgements["w"].explained
    direct = build_report(inputs, options, command=whole_audit.command, warnings=whole_audit.warnings)
    assert json.dumps(report_to_dict(direct)) == json.dumps(report_to_dict(whole_audit))


def test_the_analysis_cannot_be_called_without_saying_what_the_update_judgements_are(dumps):
    """The judgements are a required input: a caller cannot lose GA604 by forgetting them."""
    run, _ = dumps
    step = load_step(run)
    with TensorReader(step) as reader:
        measured = measure_step(step, reader)
    with pytest.raises(TypeError, match="update_judgements"):
        analyse(step, measured, coverage=coverage_by_param(step))  # type: ignore[call-arg]
    assert (
        analyse(step, measured, coverage=coverage_by_param(step), update_judgements={}).update_judgements
        == {}
    )
