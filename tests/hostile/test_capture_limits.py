"""Capture writes only what its own reader accepts, and refuses the rest at the call."""

from __future__ import annotations

import pytest
import torch

import gradaudit
from gradaudit.capture.build import whole, write_rank
from gradaudit.dumpfile import load_step
from gradaudit.dumpfile.writer import UnreadableDumpError
from gradaudit.errors import CaptureError
from gradaudit.model import ClipRecord, DataRecord


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _step(out, step=3, **kwargs):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with gradaudit.audit_step(model, out, step=step, max_norm=1.0, **kwargs) as audit:
        model(torch.ones(2, 3)).sum().backward()
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)
    return audit


def test_an_integer_run_id_is_written_as_its_string(tmp_path):
    audit = _step(tmp_path, run_id=12345)
    assert audit.path is not None
    assert load_step(audit.path.parent).ranks[0].run_id == "12345"


@pytest.mark.parametrize("run_id", [1.5, ["job"], True])
def test_a_run_id_that_is_neither_text_nor_an_integer_is_refused_at_the_call(tmp_path, run_id):
    with pytest.raises(CaptureError, match="run_id must be a string"):
        gradaudit.audit_step(torch.nn.Linear(3, 2), tmp_path, step=1, max_norm=1.0, run_id=run_id)


def test_a_step_beyond_a_64_bit_counter_is_refused_at_the_call(tmp_path):
    with pytest.raises(CaptureError, match="below 2\\*\\*63"):
        gradaudit.audit_step(torch.nn.Linear(3, 2), tmp_path, step=2**63, max_norm=1.0)
    assert _step(tmp_path, step=2**63 - 1).path.name == "rank_00000.safetensors"


@pytest.mark.parametrize(
    ("tokens", "problem"),
    [(-5, "between 0 and"), (2**70, "between 0 and"), (float("nan"), "whole number"), (2.5, "whole number")],
)
def test_a_token_count_the_reader_would_refuse_is_refused_at_record_and_the_dump_is_still_written(
    tmp_path, tokens, problem
):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0) as audit:
        model(torch.ones(2, 3)).sum().backward()
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), 1.0)
        with pytest.raises(CaptureError, match=problem):
            audit.record(tokens=tokens, loss=0.5)
        audit.record(loss=0.5)
    rank = load_step(audit.path.parent).ranks[0]
    assert rank.data.tokens is None and rank.data.loss == 0.5


@pytest.mark.parametrize("tokens", [2048, 2048.0, torch.tensor(2048), torch.tensor([2048.0])])
def test_a_token_count_given_as_a_whole_float_or_a_tensor_is_recorded(tmp_path, tokens):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=1.0) as audit:
        model(torch.ones(2, 3)).sum().backward()
        audit.record(tokens=tokens)
    assert load_step(audit.path.parent).ranks[0].data.tokens == 2048


def test_dump_refuses_a_negative_token_count_before_touching_the_gradients(tmp_path):
    model = torch.nn.Linear(3, 2)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(CaptureError, match="tokens"):
        gradaudit.dump(model, tmp_path, step=1, max_norm=1.0, tokens=-5)
    assert not any(tmp_path.rglob("*.safetensors"))


@pytest.mark.parametrize(
    ("data", "run_id", "field"),
    [
        (DataRecord(tokens=-5), None, "data.tokens"),
        (DataRecord(tokens=2**70), None, "data.tokens"),
        (DataRecord(), 12345, "run_id"),
    ],
)
def test_the_writer_checks_a_dump_with_the_readers_own_rules_and_writes_nothing_it_would_refuse(
    tmp_path, data, run_id, field
):
    with pytest.raises(UnreadableDumpError, match=f"reader would refuse it: metadata field {field}"):
        write_rank(
            tmp_path / "step_1",
            rank=0,
            world_size=1,
            step=1,
            params={"w": (2,)},
            pieces=[whole("w", grad=torch.ones(2))],
            clip=ClipRecord(max_norm=1.0),
            data=data,
            run_id=run_id,
        )
    assert list(tmp_path.rglob("*")) == [] or not any(p.is_file() for p in tmp_path.rglob("*"))
