"""Capture never breaks training: failures warn once and leave no file that looks valid; strict raises."""

from __future__ import annotations

import errno
import warnings

import pytest
import torch
from capture_support import MAX_NORM, make_model, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.dumpfile import DumpExistsError, load_step
from gradaudit.errors import CaptureError
from gradaudit.warn import CaptureWarning


def train_steps(model, out_dir, steps, **kwargs) -> list[float]:
    """Several training steps, each audited; returns the loss of each (training must go on)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in steps:
        with gradaudit.audit_step(
            model, out_dir, step=step, max_norm=MAX_NORM, optimizer=opt, **kwargs
        ) as audit:
            opt.zero_grad()
            loss = model(torch.randn(5, 4)).pow(2).mean()
            loss.backward()
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
            opt.step()
        losses.append(float(loss))
    return losses


def disk_full(monkeypatch):
    import gradaudit.dumpfile.writer

    def write_safetensors(handle, tensors, metadata):
        handle.write(b"partial")  # what a full disk leaves behind
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gradaudit.dumpfile.writer, "write_safetensors", write_safetensors)


def capture_warnings(action):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = action()
    return result, [w for w in caught if issubclass(w.category, CaptureWarning)]


def test_a_full_disk_warns_once_and_training_goes_on_without_any_file(tmp_path, monkeypatch):
    disk_full(monkeypatch)
    losses, caught = capture_warnings(lambda: train_steps(make_model(), tmp_path, [1, 2, 3]))
    assert len(losses) == 3
    assert len(caught) == 1
    assert "No space left on device" in str(caught[0].message) and "training goes on" in str(
        caught[0].message
    )
    for step in (1, 2, 3):
        assert list((tmp_path / f"step_{step}").iterdir()) == []  # neither the final name nor a temporary


def test_a_full_disk_raises_when_strict(tmp_path, monkeypatch):
    disk_full(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        train_steps(make_model(), tmp_path, [1], strict=True)
    assert list((tmp_path / "step_1").iterdir()) == []


def test_an_unwritable_output_folder_warns_once_and_training_goes_on(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the dump folder should be")
    losses, caught = capture_warnings(lambda: train_steps(make_model(), blocker, [1, 2]))
    assert len(losses) == 2 and len(caught) == 1
    assert "cannot write under" in str(caught[0].message)


def test_permission_denied_warns_and_strict_raises(tmp_path, monkeypatch):
    import gradaudit.dumpfile.writer

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(gradaudit.dumpfile.writer, "write_safetensors", denied)
    _, caught = capture_warnings(lambda: train_steps(make_model(), tmp_path, [1]))
    assert len(caught) == 1 and "Permission denied" in str(caught[0].message)
    with pytest.raises(PermissionError):
        train_steps(make_model(), tmp_path, [2], strict=True)


def test_an_earlier_dump_of_the_same_step_is_never_destroyed(tmp_path):
    train_steps(make_model(), tmp_path, [5])
    path = tmp_path / "step_5" / "rank_00000.safetensors"
    original = path.read_bytes()
    _, caught = capture_warnings(lambda: train_steps(make_model(), tmp_path, [5]))
    assert len(caught) == 1 and "already exists" in str(caught[0].message)
    assert path.read_bytes() == original
    with pytest.raises(DumpExistsError):
        train_steps(make_model(), tmp_path, [5], strict=True)
    assert path.read_bytes() == original


def test_a_parameter_that_cannot_be_mapped_is_left_out_with_one_warning(tmp_path):
    model = make_model()
    model[0].weight.tensor_model_parallel = True  # Megatron attribute, but no tensor-parallel group given
    model[0].bias.tensor_model_parallel = True
    _, caught = capture_warnings(lambda: train_steps(model, tmp_path, [1]))
    assert len(caught) == 1 and "0.weight" in str(caught[0].message)
    names = {p.param for p in load_step(tmp_path / "step_1").ranks[0].pieces}
    assert names == {"1.weight", "1.bias"}
    with pytest.raises(CaptureError, match="tensor_model_parallel"):
        train_steps(model, tmp_path, [2], strict=True)


def test_a_piece_whose_gradient_cannot_be_read_is_left_out_as_not_captured_and_warned(tmp_path):
    from gradaudit.capture.ownership import LocalPiece
    from gradaudit.model import Box

    model = make_model()

    def broken():
        raise RuntimeError("device lost")

    explicit = LocalPiece(
        param="0.weight",
        global_shape=(3, 4),
        dtype="float32",
        regions=(Box(offsets=(0, 0), shape=(3, 4)),),
        local_shape=(3, 4),
        grad=broken,
        value=lambda: model[0].weight.detach(),
    )
    _, caught = capture_warnings(lambda: train_steps(model, tmp_path, [1], ownership=[explicit]))
    assert len(caught) == 1 and "device lost" in str(caught[0].message)
    dump = load_step(tmp_path / "step_1").ranks[0]
    assert "0.weight" not in {p.param for p in dump.pieces}
    # Listed as not captured with its reason (GA104), not as a parameter whose elements nobody holds
    assert dump.param("0.weight") is None
    assert [(p.name, p.reason) for p in dump.not_captured] == [
        ("0.weight", "its grad could not be read: device lost")
    ]


def test_an_unexpected_failure_while_inferring_ownership_warns_and_the_step_runs_untouched(
    tmp_path, monkeypatch
):
    from gradaudit.capture import session

    def broken(*args, **kwargs):
        raise RuntimeError("unexpected layout")

    monkeypatch.setattr(session, "infer_ownership", broken)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        with gradaudit.audit_step(model, tmp_path, step=1, max_norm=MAX_NORM, optimizer=opt) as audit:
            model(torch.randn(5, 4)).pow(2).mean().backward()
            norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
            opt.step()
        return norm

    norm, caught = capture_warnings(step)
    assert float(norm) > 0 and len(caught) == 1 and "unexpected layout" in str(caught[0].message)
    assert not (tmp_path / "step_1").exists()
    assert len(opt._optimizer_step_pre_hooks) == 0
    with pytest.raises(RuntimeError, match="unexpected layout"):
        with gradaudit.audit_step(model, tmp_path, step=2, max_norm=MAX_NORM, strict=True):
            pass


def test_running_out_of_memory_while_copying_gives_every_copy_back_and_writes_nothing(tmp_path):
    from gradaudit.capture.ownership import LocalPiece
    from gradaudit.model import Box

    model = make_model()

    def out_of_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    explicit = LocalPiece(
        param="1.bias",
        global_shape=(3,),
        dtype="float32",
        regions=(Box(offsets=(0,), shape=(3,)),),
        local_shape=(3,),
        grad=out_of_memory,
        value=lambda: model[1].bias.detach(),
    )
    losses, caught = capture_warnings(lambda: train_steps(model, tmp_path, [1, 2], ownership=[explicit]))
    assert len(losses) == 2 and len(caught) == 1
    assert "out of memory" in str(caught[0].message)
    assert not (tmp_path / "step_1").exists()  # a missing rank, never a file that looks complete


def test_frozen_parameters_are_not_part_of_the_dump(tmp_path):
    model = make_model()
    model[1].weight.requires_grad_(False)
    model[1].bias.requires_grad_(False)
    train_steps(model, tmp_path, [1])
    dump = load_step(tmp_path / "step_1").ranks[0]
    assert {p.name for p in dump.params} == {"0.weight", "0.bias"}
    assert {p.param for p in dump.pieces} == {"0.weight", "0.bias"}


def test_a_weight_marked_shared_without_an_alias_is_kept_and_warned_about(tmp_path):
    model = make_model()
    model[1].weight.shared = True  # Megatron marks weights tied across pipeline stages so
    _, caught = capture_warnings(lambda: train_steps(model, tmp_path, [1]))
    assert len(caught) == 1 and "aliases={'1.weight'" in str(caught[0].message)
    assert "1.weight" in {p.param for p in load_step(tmp_path / "step_1").ranks[0].pieces}
