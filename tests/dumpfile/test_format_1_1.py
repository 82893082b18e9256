"""Dump format 1.1: stats-only pieces and the parameter table as binary columns; 1.0 still read."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from builders import FIXED, write_one_rank
from hostile.cli import assert_clean_refusal, run_cli

from dumpfile.formats import header_of, json_reports, rewrite_columns, stats_step, write_json_1_0
from gradaudit.capture.build import flat, whole, write_rank
from gradaudit.dumpfile import load_rank_file, load_step
from gradaudit.dumpfile.columnar import COORDS, PIECES, counts_key, stats_key, to_columns
from gradaudit.errors import DumpFormatError
from gradaudit.model import ClipRecord


def test_a_stats_only_rank_is_written_as_columns_and_read_back_equal(tmp_path):
    path = stats_step(tmp_path)
    _, _, doc = header_of(path)
    assert doc["format_version"] == "1.1" and doc["pieces"] == [] and doc["params"] == []
    assert doc["columnar"]["num_pieces"] == 3 and doc["columnar"]["kinds"] == ["grad"]
    dump = load_rank_file(path)
    assert [p.param for p in dump.pieces] == ["layers.0.w", "emb", "norm"]
    assert dump.pieces[0].stats["grad"].num_nan == 1
    assert dump.pieces[2].replica_group == "dp"
    assert [(p.name, p.global_shape, p.dtype) for p in dump.params] == [
        ("layers.0.w", (12, 4), "float32"),
        ("emb", (10, 3), "float32"),
        ("norm", (5,), "float32"),
    ]
    rebuilt = to_columns(dump)
    assert rebuilt is not None


@pytest.mark.parametrize(
    "pieces",
    [
        [whole("w", grad=torch.ones(4))],
        [whole("w", grad=torch.ones(4), stats_only=True, local_name="_fsdp_flat")],
        [flat("w", 0, grad=torch.ones(2), stats_only=True), flat("w", 2, grad=torch.ones(2))],
    ],
    ids=["values", "local-name", "mixed"],
)
def test_pieces_that_columns_cannot_hold_exactly_are_written_as_json(tmp_path, pieces):
    path = write_one_rank(
        tmp_path,
        params={"w": (4,)},
        pieces=pieces,
    )
    _, _, doc = header_of(path)
    assert "columnar" not in doc and len(doc["pieces"]) == len(pieces)
    assert len(load_rank_file(path).pieces) == len(pieces)


def test_a_step_of_columnar_ranks_gives_the_same_report_as_its_json_form(tmp_path, capsys):
    for rank in range(2):
        stats_step(tmp_path / "v11", rank=rank)
        dump = load_rank_file(tmp_path / "v11" / f"rank_{rank:05d}.safetensors")
        write_json_1_0(tmp_path / "v10", dump)
    reports = json_reports(capsys, tmp_path / "v10", tmp_path / "v11")
    assert reports[0] == reports[1]
    a, b = load_step(tmp_path / "v10"), load_step(tmp_path / "v11")
    assert [dataclasses.replace(d, path="", num_bytes=0) for d in a.ranks.values()] == [
        dataclasses.replace(d, path="", num_bytes=0) for d in b.ranks.values()
    ]


def test_the_header_of_a_many_piece_stats_rank_stays_under_64_bytes_per_piece(tmp_path):
    num = 400
    write_rank(
        tmp_path,
        rank=0,
        world_size=4,
        step=1,
        params={f"model.layers.{i}.self_attn.q_proj.weight": (64, 32) for i in range(num)},
        pieces=[
            flat(f"model.layers.{i}.self_attn.q_proj.weight", 0, grad=torch.randn(512), stats_only=True)
            for i in range(num)
        ],
        clip=ClipRecord(max_norm=1.0),
        **FIXED,
    )
    length, _, _ = header_of(tmp_path / "rank_00000.safetensors")
    assert length / num <= 64


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda a, d: a[PIECES].__setitem__((0, 0), 7), "a parameter index is outside the parameter list"),
        (lambda a, d: a[COORDS].__setitem__(-1, 10**6), r"box \[0\] \+ \[1000000\] is outside 'norm'"),
        (lambda a, d: a[counts_key("grad")].__setitem__((1, 0), -1), "nonfinite counts must be non-negative"),
        (lambda a, d: a[stats_key("grad")].__setitem__((1, 1), -2.0), "must be non-negative numbers"),
        (lambda a, d: a.pop(COORDS), "tensor __gradaudit__.coords is missing"),
        (lambda a, d: d["columnar"].__setitem__("num_pieces", 4), "has dtype int64 and shape"),
        (
            lambda a, d: d.__setitem__("pieces", [{"param": "emb"}]),
            "must be empty when the pieces are stored",
        ),
    ],
    ids=["param-index", "range", "counts", "sums", "missing-column", "num-pieces", "json-and-columns"],
)
def test_broken_columns_are_refused_with_one_line_naming_the_file(tmp_path, capsys, edit, problem):
    path = stats_step(tmp_path, world_size=1)
    rewrite_columns(path, edit)
    with pytest.raises(DumpFormatError):
        load_rank_file(path)
    outcome = run_cli(capsys, "check", str(tmp_path))
    assert_clean_refusal(outcome, names=path.name, problem=problem)


def test_columns_are_read_without_torch_as_plain_little_endian_arrays(tmp_path):
    path = stats_step(tmp_path, world_size=1)
    from safetensors.numpy import load_file

    arrays = load_file(str(path))
    assert arrays[PIECES].dtype == np.int64 and arrays[PIECES].shape == (3, 4)
    assert arrays[PIECES][:, 3].tolist() == [2, 0, 1]  # a 2-D box, a flat range, a 1-D box
