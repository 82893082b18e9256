"""Per-clip-call evidence: statistics of each piece's gradient before every clip call of a step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from builders import write_one_rank
from capture_support import MAX_NORM, make_model, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.capture.build import box
from gradaudit.capture.tensorstats import stats_of_tensor
from gradaudit.dumpfile import TensorReader, load_step
from gradaudit.dumpfile.header import read_header
from gradaudit.errors import DumpFormatError
from gradaudit.model import ClipCall, ClipRecord


def _two_call_clip() -> ClipRecord:
    return ClipRecord(max_norm=1.0, calls=(ClipCall(reported_norm=0.0), ClipCall(reported_norm=2.0)))


def test_call_stats_written_by_the_builder_load_back_equal(tmp_path):
    g = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    first = stats_of_tensor(torch.zeros(2, 3), 2.0)
    write_one_rank(
        tmp_path,
        params={"w": (2, 3)},
        pieces=[box("w", (0, 0), grad=g, call_stats=(first, g))],
        clip=_two_call_clip(),
    )
    (piece,) = load_step(tmp_path).ranks[0].pieces
    assert piece.call_stats == (first, stats_of_tensor(g, 2.0))
    assert piece.call_stats[1].sum_sq == pytest.approx(float(g.pow(2).sum()))


def test_a_file_without_call_stats_loads_with_an_empty_tuple(tmp_path):
    write_one_rank(
        tmp_path,
        params={"w": (2,)},
        pieces=[box("w", (0,), grad=torch.ones(2))],
    )
    path = next(tmp_path.glob("rank_*.safetensors"))
    assert "call_stats" not in read_header(str(path)).metadata["gradaudit"]
    assert load_step(tmp_path).ranks[0].pieces[0].call_stats == ()


def test_call_stats_of_the_wrong_size_are_refused_naming_the_field(tmp_path):
    write_one_rank(
        tmp_path,
        params={"w": (2,)},
        pieces=[box("w", (0,), grad=torch.ones(2), call_stats=(torch.ones(2), torch.ones(2)))],
        clip=_two_call_clip(),
    )
    path = next(tmp_path.glob("rank_*.safetensors"))
    from gradaudit.dumpfile.schema import decode_rank

    doc = json.loads(read_header(str(path)).metadata["gradaudit"])
    doc["pieces"][0]["call_stats"][1]["numel"] = 3
    with pytest.raises(DumpFormatError, match=r"pieces\[0\]\.call_stats\[1\]\.numel"):
        decode_rank(doc, str(path))


def _backward(model, seed: int) -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()


def test_two_clip_calls_record_the_gradient_before_each_and_dump_the_one_before_the_last(tmp_path):
    model = make_model()
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=MAX_NORM, strict=True) as audit:
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)  # no gradient yet
        _backward(model, 1)
        before_second = {n: p.grad.clone() for n, p in model.named_parameters()}
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    step = load_step(tmp_path / "step_1")
    dump = step.ranks[0]
    assert len(dump.clip.calls) == 2
    with TensorReader() as reader:
        for piece in dump.pieces:
            first, second = piece.call_stats
            assert first.sum_sq == 0.0 and first.numel == piece.numel
            assert second.sum_sq == pytest.approx(float(before_second[piece.param].double().pow(2).sum()))
            assert torch.equal(reader.read(dump.path, piece.tensors["grad"]), before_second[piece.param])
    total = math.sqrt(sum(p.call_stats[1].sum_sq for p in dump.pieces))
    assert total == pytest.approx(dump.clip.calls[1].reported_norm, rel=1e-5)


@pytest.mark.parametrize("mode", ["full", "stats"])
def test_one_clip_call_writes_no_call_stats(tmp_path, mode):
    model = make_model()
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=MAX_NORM, mode=mode, strict=True) as audit:
        _backward(model, 1)
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    assert all(p.call_stats == () for p in load_step(tmp_path / "step_1").ranks[0].pieces)


def test_stats_mode_records_call_stats_of_three_calls(tmp_path):
    model = make_model()
    norms = []
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=MAX_NORM, mode="stats", strict=True) as audit:
        for seed in (1, 2, 3):
            _backward(model, seed)
            norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
            audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
    pieces = load_step(tmp_path / "step_1").ranks[0].pieces
    for i, expected in enumerate(norms):
        assert math.sqrt(sum(p.call_stats[i].sum_sq for p in pieces)) == pytest.approx(expected, rel=1e-5)
