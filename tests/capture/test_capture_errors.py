"""Mistakes in the call raise CaptureError at once, with what to pass instead."""

from __future__ import annotations

import pytest
import torch

import gradaudit
from gradaudit.errors import CaptureError, GradauditError


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def model():
    return torch.nn.Linear(3, 2)


def test_a_distributed_launch_without_a_process_group_raises(model, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(CaptureError, match="init_process_group"):
        gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0)


def test_world_size_one_without_a_process_group_is_a_single_process(model, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0):
        model(torch.ones(1, 3)).sum().backward()
    assert (tmp_path / "step_1" / "rank_00000.safetensors").exists()


def test_missing_max_norm_raises(model, tmp_path):
    with pytest.raises(CaptureError, match=r"max_norm=.*e\.g\. max_norm=1\.0"):
        gradaudit.audit_step(model, tmp_path, step=1)
    with pytest.raises(CaptureError, match="max_norm"):
        gradaudit.dump(model, tmp_path, step=1, max_norm=0.0)


def test_an_alias_key_that_is_not_a_parameter_of_this_rank_raises(model, tmp_path):
    with pytest.raises(CaptureError, match=r"'lm_head\.weight' is not a parameter .*\(e\.g\. bias, weight\)"):
        with gradaudit.audit_step(
            model, tmp_path, step=1, max_norm=1.0, aliases={"lm_head.weight": "embed.weight"}
        ):
            pass
    assert not (tmp_path / "step_1").exists()


def test_an_unknown_mode_raises(model, tmp_path):
    with pytest.raises(CaptureError, match="mode='full'.*mode='stats'"):
        gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0, mode="everything")


@pytest.mark.parametrize("step", [-1, 1.5, "7", None, True])
def test_a_step_that_is_not_a_non_negative_int_raises(model, tmp_path, step):
    with pytest.raises(CaptureError, match="step must be"):
        gradaudit.audit_step(model, tmp_path, step=step, max_norm=1.0)


def test_a_group_given_as_something_else_than_ranks_or_a_process_group_raises(model, tmp_path):
    with pytest.raises(CaptureError, match="ProcessGroup"):
        gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0, groups={"tp": "0,1"})


def test_clip_outside_the_with_block_raises(model, tmp_path):
    audit = gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0)
    with pytest.raises(CaptureError, match="inside"):
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)


def test_capture_errors_are_gradaudit_errors_so_the_cli_maps_them_to_exit_2():
    assert issubclass(CaptureError, GradauditError)


def test_dump_given_an_optimizer_says_to_use_audit_step(model, tmp_path):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        CaptureError, match=r"dump\(\) records gradients as they are now; pass optimizer= to audit_step"
    ):
        gradaudit.dump(model, tmp_path, step=1, max_norm=1.0, optimizer=opt)
    assert not (tmp_path / "step_1").exists()


def test_a_misspelt_option_is_a_type_error_naming_it(model, tmp_path):
    with pytest.raises(TypeError, match="max_nrom"):
        gradaudit.audit_step(model, tmp_path, step=1, max_nrom=1.0)
