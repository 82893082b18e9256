"""check_clip_parity on a step whose clip is written inline (no clip function called, nothing for the
check to intercept) under FSDP2 on 2 gloo ranks: judged from the gradients after the backward and the
norm the step returns, with a note that no clip call was seen and how to name one (clip=)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gradaudit.testing import ClipNotSeen, ParityFailure, check_clip_parity

pytestmark = pytest.mark.integration

NOTE = "no clip call was seen (sharded steps 1, 2; reference steps 1, 2)"


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def shard(model, mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_batch(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=generator), 3 * torch.randn(4, 4, generator=generator)


def _backward(model, batch):
    inputs, targets = batch
    F.mse_loss(model(inputs), targets).backward()
    return [p.grad for p in model.parameters()]


def _local(grad):
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _scale(grads, norm, max_norm):
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        _local(grad).mul_(coef)


def inline_local_clip(model, batch, max_norm):
    """The bug the fixture exists for, written out in the step: the norm of this rank's shards only."""
    grads = _backward(model, batch)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(_local(g)) for g in grads]))
    _scale(grads, norm, max_norm)
    return norm


def inline_global_clip(model, batch, max_norm):
    grads = _backward(model, batch)
    whole = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in whole]))
    _scale(grads, norm, max_norm)
    return norm


def test_an_inline_local_clip_under_fsdp2_fails_naming_ga201_and_that_no_clip_call_was_seen(tmp_path):
    with pytest.raises(ParityFailure) as failed:
        check_clip_parity(
            build=build,
            parallelize=shard,
            make_batch=make_batch,
            step=inline_local_clip,
            world_size=2,
            out_dir=tmp_path,
        )
    message = str(failed.value)
    assert "does not clip like the unsharded reference on 2 of 2 steps" in message
    assert "GA201: clipping used a local norm on ranks 0-1" in message
    # the clipped gradients and the next weights are compared with the reference
    assert "GA603 error: clipped gradients differ" in message and "the next weights differ" in message
    assert "(local_only)" in message
    assert NOTE in message and "pass the function your step clips with as clip=" in message
    assert "pass the function your step clips with as clip= (defined" not in message.split("note:")[0]


def test_an_inline_correct_clip_passes_with_the_note_as_a_warning_and_on_each_report(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reports = check_clip_parity(
            build=build,
            parallelize=shard,
            make_batch=make_batch,
            step=inline_global_clip,
            world_size=2,
            out_dir=tmp_path,
        )
    assert [r.step for r in reports] == [1, 2]
    assert all(f.severity.value == "info" for r in reports for f in r.findings)
    (note,) = [str(w.message) for w in caught if issubclass(w.category, ClipNotSeen)]
    assert note.startswith("check_clip_parity passed; note: " + NOTE)
    assert "as clip=" in note
    assert all(r.warnings[-1] == note.removeprefix("check_clip_parity passed; ") for r in reports)
