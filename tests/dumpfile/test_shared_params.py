"""Format 1.1 shared parameter tables: one table file per distinct table in a step folder, named by
its hash, written without overwriting anything, read once per step and checked against its hash."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import shutil
import struct

import pytest
import torch
from builders import FIXED
from hostile.cli import assert_clean_refusal, run_cli

from gradaudit.capture.build import flat, whole, write_rank
from gradaudit.dumpfile import load_rank_file, load_step
from gradaudit.dumpfile.paramtable import TABLE_METADATA_KEY, is_table_file
from gradaudit.dumpfile.schema import METADATA_KEY
from gradaudit.model import ClipRecord

PARAMS = {"layers.0.w": (64, 8), "emb": (100, 4), "norm": (8,)}


def _write(
    directory, rank: int, world_size: int = 4, *, step: int = 3, share_params: bool = True, params=None
):
    gen = torch.Generator().manual_seed(rank)
    params = params or PARAMS
    share = 512 // world_size
    return write_rank(
        directory,
        rank=rank,
        world_size=world_size,
        step=step,
        params=params,
        pieces=[
            flat("layers.0.w", share * rank, grad=torch.randn(share, generator=gen), stats_only=True),
            flat(
                "emb",
                400 // world_size * rank,
                grad=torch.randn(400 // world_size, generator=gen),
                stats_only=True,
            ),
            whole("norm", grad=torch.randn(8, generator=gen), replica_group="dp", stats_only=True),
        ],
        clip=ClipRecord(max_norm=1.0, reported_norm=2.0),
        share_params=share_params,
        **FIXED,
    )


def _document(path) -> dict:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(json.loads(raw[8 : 8 + length])["__metadata__"][METADATA_KEY])


def _tables(directory) -> list:
    return sorted(p for p in directory.iterdir() if is_table_file(p.name))


def _step(directory, world_size: int = 4, **kw):
    return [_write(directory, rank, world_size, **kw) for rank in range(world_size)]


def test_the_ranks_of_a_step_write_one_table_file_and_name_it_with_its_hash(tmp_path):
    files = _step(tmp_path / "shared")
    inline = _step(tmp_path / "inline", share_params=False)
    (table,) = _tables(tmp_path / "shared")
    assert not _tables(tmp_path / "inline")
    reference = _document(files[0])["columnar"]["params"]
    assert reference["file"] == table.name and table.name == f"params_{reference['sha256'][:16]}.safetensors"
    assert all(_document(f)["columnar"]["params"] == reference for f in files)
    assert _document(inline[0])["columnar"]["params"] == "columns"
    from safetensors.numpy import load_file, safe_open

    assert set(load_file(str(table))) == {
        "__gradaudit__.params.names",
        "__gradaudit__.params.meta",
        "__gradaudit__.params.dims",
    }
    with safe_open(str(table), framework="numpy") as handle:
        assert handle.metadata() == {TABLE_METADATA_KEY: "1.1"}
    assert all(not any(k.startswith("__gradaudit__.params") for k in load_file(str(f))) for f in files)
    assert files[0].stat().st_size < inline[0].stat().st_size
    shared, alone = load_step(tmp_path / "shared"), load_step(tmp_path / "inline")
    assert shared.warnings == () and shared.inconsistencies == ()
    for rank in range(4):
        a, b = shared.ranks[rank], alone.ranks[rank]
        assert dataclasses.replace(a, path="", num_bytes=0) == dataclasses.replace(b, path="", num_bytes=0)
    assert shared.ranks[0].params[0] is shared.ranks[3].params[0]  # decoded once per step


@pytest.mark.parametrize("command", ["check", "show"])
def test_a_step_with_a_shared_table_gives_the_same_report_as_with_inline_tables(tmp_path, capsys, command):
    _step(tmp_path / "shared")
    _step(tmp_path / "inline", share_params=False)
    reports = []
    for name in ("shared", "inline"):
        outcome = run_cli(capsys, command, str(tmp_path / name), "--format", "json")
        assert outcome.code in (0, 1), outcome.stderr
        assert "params_" not in outcome.stderr
        report = json.loads(outcome.stdout)
        report.pop("command", None)
        report.pop("bytes", None)  # show's sizes of the rank files, smaller without the table
        reports.append(json.dumps(report, sort_keys=True).replace(str(tmp_path / name), "STEP"))
    assert reports[0] == reports[1]


def _write_in_child(args) -> str:
    directory, rank = args
    return str(_write(directory, rank, world_size=16))


def test_ranks_writing_at_the_same_time_end_with_one_table_file_that_every_rank_names(tmp_path):
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        pool.map(_write_in_child, [(tmp_path, rank) for rank in range(16)])
    (table,) = _tables(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
    step = load_step(tmp_path)
    assert sorted(step.ranks) == list(range(16)) and step.warnings == ()
    assert {
        _document(tmp_path / f"rank_{r:05d}.safetensors")["columnar"]["params"]["file"] for r in range(16)
    } == {table.name}


def test_a_step_folder_gathered_from_two_nodes_has_one_table_and_loads(tmp_path):
    for node, ranks in (("node_a", (0, 1)), ("node_b", (2, 3))):
        for rank in ranks:
            _write(tmp_path / node / "step_3", rank)
    gathered = tmp_path / "gathered" / "step_3"
    gathered.mkdir(parents=True)
    for node in ("node_a", "node_b"):
        for path in (tmp_path / node / "step_3").iterdir():
            if not (gathered / path.name).exists():  # cp -n
                shutil.copy2(path, gathered / path.name)
            else:
                assert (gathered / path.name).read_bytes() == path.read_bytes()
    assert len(_tables(gathered)) == 1
    step = load_step(gathered)
    assert sorted(step.ranks) == [0, 1, 2, 3] and step.warnings == ()


def test_an_existing_different_file_under_the_table_name_is_kept_and_the_table_goes_inline(tmp_path):
    first = _write(tmp_path / "probe", 0)
    (table,) = _tables(tmp_path / "probe")
    step_dir = tmp_path / "step"
    step_dir.mkdir()
    (step_dir / table.name).write_bytes(b"someone else's file")
    written = _write(step_dir, 0)
    assert (step_dir / table.name).read_bytes() == b"someone else's file"
    assert _document(written)["columnar"]["params"] == "columns"
    assert load_rank_file(written).params == load_rank_file(first).params


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda table: table.unlink(), r"its parameter table .*params_[0-9a-f]{16}\.safetensors is missing"),
        (
            lambda table: table.write_bytes(table.read_bytes()[:-3] + b"xyz"),
            r"its parameter table .*params_[0-9a-f]{16}\.safetensors does not have the SHA-256",
        ),
        (
            lambda table: table.write_bytes(table.read_bytes()[:-9]),
            r"its parameter table .*params_[0-9a-f]{16}\.safetensors is corrupt",
        ),
    ],
    ids=["missing", "changed", "truncated"],
)
def test_a_missing_or_corrupt_table_file_is_refused_in_one_line_naming_the_rank_and_the_table(
    tmp_path, capsys, damage, problem
):
    files = _step(tmp_path)
    (table,) = _tables(tmp_path)
    damage(table)
    for command in ("check", "show"):
        outcome = run_cli(capsys, command, str(tmp_path))
        line = assert_clean_refusal(outcome, names=files[0].name, problem=problem)
        assert table.name in line


def test_with_allow_incomplete_ranks_ranks_whose_table_is_missing_are_missing_ranks_with_the_reason(
    tmp_path, capsys
):
    _step(tmp_path, world_size=4)
    other = {"layers.0.w": (64, 8), "emb": (100, 4), "norm": (8,), "head": (3,)}
    (before,) = _tables(tmp_path)
    (tmp_path / "rank_00003.safetensors").unlink()
    _write(tmp_path, 3, params=other)  # rank 3 names a second table
    (second,) = [t for t in _tables(tmp_path) if t != before]
    second.unlink()
    outcome = run_cli(capsys, "check", str(tmp_path), "--allow-incomplete-ranks", "--format", "json")
    assert outcome.code == 1, outcome.stderr
    report = json.loads(outcome.stdout)
    assert report["missing_ranks"] == [[3, 3]]
    assert any("rank_00003" in w and second.name in w and "is missing" in w for w in report["warnings"])


def test_stray_table_files_and_table_temporaries_are_warned_about_not_read_as_ranks(tmp_path):
    _step(tmp_path, world_size=2)
    stray = tmp_path / "params_0123456789abcdef.safetensors"
    stray.write_bytes(b"not referenced")
    temporary = tmp_path / ".params_0123456789abcdef.safetensors.tmp-host-123"
    temporary.write_bytes(b"half")
    step = load_step(tmp_path)
    assert sorted(step.ranks) == [0, 1]
    assert any(str(stray) in w and "no rank file names" in w for w in step.warnings)
    assert any(str(temporary) in w and "temporary" in w for w in step.warnings)


def test_a_folder_of_step_folders_each_with_its_table_is_checked_step_by_step(tmp_path, capsys):
    for step in (3, 4):
        _step(tmp_path / f"step_{step}", world_size=2, step=step)
    outcome = run_cli(capsys, "check", str(tmp_path), "--format", "json")
    assert outcome.code in (0, 1), outcome.stderr
    assert "params_" not in outcome.stderr


def test_a_rank_naming_an_invalid_table_reference_is_refused(tmp_path, capsys):
    files = _step(tmp_path, world_size=1)
    raw = files[0].read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    doc = json.loads(header["__metadata__"][METADATA_KEY])
    doc["columnar"]["params"] = {"file": "../../etc/passwd", "sha256": "0" * 64}
    header["__metadata__"][METADATA_KEY] = json.dumps(doc)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    files[0].write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    outcome = run_cli(capsys, "check", str(tmp_path))
    assert_clean_refusal(outcome, names=files[0].name, problem="columnar params: not 'columns'")
