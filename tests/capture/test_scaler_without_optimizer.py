"""A GradScaler given without optimizer= (a framework that hooks its optimizer itself) is still read:
it tracks one optimizer, so whether unscale_ ran before the clip call is known, not guessed."""

from __future__ import annotations

import torch
from capture_support import MAX_NORM, make_model, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.dumpfile import load_step


def _step(tmp_path, *, unscale_first: bool, second_optimizer: bool = False):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    audit = gradaudit.begin_audit(model, tmp_path, step=4, max_norm=MAX_NORM, scaler=scaler)
    scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
    if second_optimizer:
        extra = torch.nn.Parameter(torch.ones(2))
        extra.grad = torch.ones(2)
        scaler.unscale_(torch.optim.SGD([extra], lr=0.1))
    if unscale_first:
        scaler.unscale_(opt)
    audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    audit.end()
    return load_step(tmp_path / "step_4").clip


def test_a_scaler_tracking_one_optimizer_records_that_unscale_ran_before_the_clip(tmp_path):
    clip = _step(tmp_path, unscale_first=True)
    assert [c.unscaled for c in clip.calls] == [True] and clip.loss_scale == 256.0


def test_a_scaler_that_has_not_unscaled_yet_records_unknown_rather_than_a_guess(tmp_path):
    clip = _step(tmp_path, unscale_first=False)
    assert [c.unscaled for c in clip.calls] == [None] and clip.calls[0].loss_scale == 256.0


def test_a_scaler_tracking_two_optimizers_without_optimizer_given_records_unknown(tmp_path):
    clip = _step(tmp_path, unscale_first=True, second_optimizer=True)
    assert [c.unscaled for c in clip.calls] == [None]
