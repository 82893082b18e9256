"""The begin/end form of the audit, clip interception, and optimizer wrappers (one process)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from capture_support import MAX_NORM, make_model, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.dumpfile import load_step
from gradaudit.errors import CaptureError
from gradaudit.warn import CaptureWarning


def backward(model):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()


class StepWrapper:
    """What frameworks hand their users: the torch optimizer behind `.optimizer`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        self.optimizer.step()


def test_begin_then_end_writes_the_same_record_as_the_context_manager(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    audit = gradaudit.begin_audit(model, tmp_path, step=3, max_norm=MAX_NORM, optimizer=StepWrapper(opt))
    backward(model)
    norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    opt.step()
    path = audit.end()
    assert path is not None and path.exists()
    step = load_step(tmp_path / "step_3")
    assert step.clip.reported_norm == pytest.approx(float(norm))
    assert step.clip.step_skipped is False
    assert all(p.has("param_before") and p.has("param_after") for p in step.ranks[0].pieces)
    assert audit.end() == path  # a second end() writes nothing new


def test_intercepted_clip_is_recorded_and_the_attribute_is_restored_on_end(tmp_path):
    model = make_model()
    owner = types.SimpleNamespace(clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    audit = gradaudit.begin_audit(model, tmp_path, step=1, max_norm=MAX_NORM)
    audit.intercept_clip(owner, "clip_grad_norm_")
    backward(model)
    norm = owner.clip_grad_norm_(model.parameters(), MAX_NORM)
    audit.end()
    assert owner.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_
    clip = load_step(tmp_path / "step_1").clip
    assert len(clip.calls) == 1 and clip.calls[0].reported_norm == pytest.approx(float(norm))
    assert clip.calls[0].max_norm == MAX_NORM


def test_cancel_writes_nothing_and_restores_the_attribute(tmp_path):
    model = make_model()
    owner = types.SimpleNamespace(clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    audit = gradaudit.begin_audit(model, tmp_path, step=1, max_norm=MAX_NORM)
    audit.intercept_clip(owner, "clip_grad_norm_")
    audit.cancel()
    assert vars(owner)["clip_grad_norm_"] is torch.nn.utils.clip_grad_norm_
    assert not (tmp_path / "step_1").exists()


def test_ending_an_audit_never_begun_or_beginning_twice_is_refused(tmp_path):
    model = make_model()
    audit = gradaudit.AuditStep(model, tmp_path, step=1, max_norm=MAX_NORM)
    with pytest.raises(CaptureError, match="never begun"):
        audit.end()
    audit.begin()
    with pytest.raises(CaptureError, match="already begun"):
        audit.begin()
    audit.cancel()


def test_an_optimizer_that_cannot_be_hooked_warns_at_the_users_line_saying_what_to_pass(tmp_path):
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradaudit.begin_audit(model, tmp_path, step=1, max_norm=MAX_NORM, optimizer=object()).cancel()
    (warning,) = [w for w in caught if issubclass(w.category, CaptureWarning)]
    assert warning.filename == __file__
    assert "Pass the torch.optim.Optimizer that it wraps instead" in str(warning.message)


def test_a_grad_scaler_is_read_through_the_optimizer_behind_a_wrapper(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    audit = gradaudit.begin_audit(
        model, tmp_path, step=2, max_norm=MAX_NORM, optimizer=StepWrapper(opt), scaler=scaler
    )
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    scaler.unscale_(opt)
    audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    scaler.step(opt)
    scaler.update()
    audit.end()
    clip = load_step(tmp_path / "step_2").clip
    assert [c.unscaled for c in clip.calls] == [True]
    assert clip.found_inf is False and clip.step_skipped is False
