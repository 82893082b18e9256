"""A rank file's header is decoded once per check: the tensor reader recognises the file it was loaded
from by its header's digest, and still refuses one changed since (full-mode files used to be
loaded twice, once by the loader and once more by every reader thread that opened them)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import safetensors.torch

from gradaudit.dumpfile import TensorReader, load_step, loader
from gradaudit.errors import DumpFormatError

from .cli import run_cli
from .corpus import rank_path, write_valid_step


@pytest.fixture
def decodes(monkeypatch):
    """The paths `_load_rank_from` decodes, in order."""
    seen: list[str] = []
    real = loader._load_rank_from

    def counted(handle, path, *args, **kwargs):
        seen.append(path)
        return real(handle, path, *args, **kwargs)

    monkeypatch.setattr(loader, "_load_rank_from", counted)
    return seen


def test_a_full_mode_check_decodes_each_rank_file_once_and_reads_its_tensors(tmp_path, capsys, decodes):
    step_dir = write_valid_step(tmp_path / "step_7")
    outcome = run_cli(capsys, "check", str(step_dir), "--format", "json")
    assert outcome.code == 0, outcome.stderr
    ranks = [safetensors.torch.load_file(rank_path(step_dir, r)) for r in (0, 1)]
    w_rows = sum(float(rank["w::grad::0"].double().pow(2).sum()) for rank in ranks)
    b_once = float(ranks[0]["b::grad::1"].double().pow(2).sum())  # replicated over dp: counted once
    assert json.loads(outcome.stdout)["global_norm"] == pytest.approx(math.sqrt(w_rows + b_once), rel=1e-12)
    assert sorted(decodes) == sorted(str(rank_path(step_dir, r)) for r in (0, 1))


def test_the_reference_files_are_recognised_too(tmp_path, decodes):
    step = load_step(write_valid_step(tmp_path / "step_7"))
    reference = load_step(write_valid_step(tmp_path / "ref" / "step_7"))
    decodes.clear()
    with TensorReader(step, reference) as reader:
        for dump in (*step.ranks.values(), *reference.ranks.values()):
            piece = dump.pieces[0]
            assert reader.float64(dump.path, piece.tensors["grad"], 0, 1).size == 1
    assert decodes == []


def test_a_header_edited_in_place_after_loading_is_refused_though_its_pieces_are_the_same(tmp_path):
    """Same size, same pieces, one byte of provenance changed: before, the reader compared pieces and
    let it through; the digest sees every byte of the header."""
    step_dir = write_valid_step(tmp_path / "step_7")
    step = load_step(step_dir)
    path = rank_path(step_dir, 0)
    data = path.read_bytes()
    at = data.index(b'"step')
    edited = data[:at] + data[at:].replace(b'"step', b'"stEp', 1)
    path.write_bytes(edited)
    with (
        TensorReader(step) as reader,
        pytest.raises(DumpFormatError, match="changed on disk after it was loaded"),
    ):
        dump = step.ranks[0]
        reader.float64(dump.path, dump.pieces[0].tensors["grad"], 0, 1)


def test_a_reference_file_replaced_after_loading_is_refused(tmp_path):
    step = load_step(write_valid_step(tmp_path / "step_7"))
    reference_dir = write_valid_step(tmp_path / "ref" / "step_7")
    reference = load_step(reference_dir)
    other = write_valid_step(tmp_path / "other" / "step_7", names=("v", "c"))
    shutil.copyfile(rank_path(other, 0), rank_path(reference_dir, 0))
    with (
        TensorReader(step, reference) as reader,
        pytest.raises(DumpFormatError, match="changed on disk after it was loaded"),
    ):
        dump = reference.ranks[0]
        reader.float64(dump.path, dump.pieces[0].tensors["grad"], 0, 1)
