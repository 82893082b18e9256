"""Auditing chosen steps of a loop in one line (steps=/every=/enabled=), and a step whose rank file exists
refused when the audit opens, before any capture is paid for."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from capture_support import MAX_NORM, make_model, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.capture.snapshots import Snapshots
from gradaudit.dumpfile import DumpExistsError, load_step
from gradaudit.errors import CaptureError
from gradaudit.warn import CaptureWarning


def _backward(model):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).mean().backward()


def _loop(model, out_dir, num_steps, **selection):
    """A training loop written once, audited as `selection` says; returns what each clip call returned."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    norms = []
    for step in range(1, num_steps + 1):
        opt.zero_grad()
        with gradaudit.audit_step(
            model, out_dir, step=step, max_norm=MAX_NORM, optimizer=opt, **selection
        ) as audit:
            _backward(model)
            norms.append(audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM))
            opt.step()
    return norms


def _written(out_dir):
    return sorted(int(p.name.removeprefix("step_")) for p in out_dir.glob("step_*") if any(p.iterdir()))


def test_every_n_audits_every_nth_step_and_clip_returns_the_norm_on_the_others(tmp_path):
    norms = _loop(make_model(), tmp_path, 4, every=2)
    assert _written(tmp_path) == [2, 4]
    assert all(isinstance(n, torch.Tensor) and n.ndim == 0 for n in norms)
    # The same loop unaudited clips to the same norms: the audit changes nothing on any step.
    plain = _loop(make_model(), tmp_path / "none", 4, enabled=False)
    assert [float(n) for n in norms] == [float(n) for n in plain]
    assert not (tmp_path / "none").exists() or _written(tmp_path / "none") == []
    assert load_step(tmp_path / "step_2").clip.reported_norm == pytest.approx(float(norms[1]))


def test_steps_list_audits_those_steps_and_refuses_both_forms_at_once(tmp_path):
    _loop(make_model(), tmp_path, 3, steps=[1, 3])
    assert _written(tmp_path) == [1, 3]
    with pytest.raises(CaptureError, match="not both"):
        gradaudit.audit_step(make_model(), tmp_path, step=1, max_norm=MAX_NORM, steps=[1], every=2)
    with pytest.raises(CaptureError, match="enabled="):
        gradaudit.audit_step(make_model(), tmp_path, step=1, max_norm=MAX_NORM, enabled="yes")


def test_begin_audit_on_a_step_left_out_is_a_no_op_that_still_clips(tmp_path):
    model = make_model()
    owner = types.SimpleNamespace(clip_grad_norm_=torch.nn.utils.clip_grad_norm_)
    audit = gradaudit.begin_audit(model, tmp_path, step=5, max_norm=MAX_NORM, steps=[10])
    audit.intercept_clip(owner, "clip_grad_norm_")
    assert owner.clip_grad_norm_ is torch.nn.utils.clip_grad_norm_  # nothing to route on this step
    _backward(model)
    norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    assert float(norm) > 0
    assert audit.end() is None and not (tmp_path / "step_5").exists()


def test_an_existing_rank_file_is_warned_about_when_the_audit_opens_and_nothing_is_captured(
    tmp_path, monkeypatch
):
    _loop(make_model(), tmp_path, 1)
    path = tmp_path / "step_1" / "rank_00000.safetensors"
    original = path.read_bytes()
    taken = []
    monkeypatch.setattr(Snapshots, "take", lambda self, kind, **kw: taken.append(kind))
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        audit = gradaudit.begin_audit(model, tmp_path, step=1, max_norm=MAX_NORM)
    messages = [str(w.message) for w in caught if issubclass(w.category, CaptureWarning)]
    assert len(messages) == 1 and "already exists" in messages[0] and "not capturing" in messages[0]
    _backward(model)
    norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    assert float(norm) > 0 and audit.end() is None
    assert taken == [] and path.read_bytes() == original
    with pytest.raises(DumpExistsError, match="already exists"):
        gradaudit.begin_audit(make_model(), tmp_path, step=1, max_norm=MAX_NORM, strict=True)


def test_the_dump_records_the_api_that_captured_it(tmp_path):
    model = make_model()
    with gradaudit.audit_step(model, tmp_path / "a", step=1, max_norm=MAX_NORM):
        _backward(model)
    audit = gradaudit.begin_audit(model, tmp_path / "b", step=1, max_norm=MAX_NORM)
    audit.end()
    gradaudit.dump(model, tmp_path / "c", step=1, max_norm=MAX_NORM)
    apis = [load_step(tmp_path / name / "step_1").ranks[0].capture_api for name in "abc"]
    assert apis == ["audit_step", "begin_audit", "dump"]
