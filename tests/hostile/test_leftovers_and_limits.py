"""Leftovers and limits: stale temporaries, huge claimed worlds, dense headers, the umask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradaudit.capture.build import whole, write_rank
from gradaudit.dumpfile.tempfiles import temporary_prefix
from gradaudit.model import ClipRecord

from .cli import assert_clean_refusal, run_cli
from .corpus import edit_metadata, rank_path, write_valid_step


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def _write_rank_0(step_dir: Path) -> Path:
    return write_rank(
        step_dir,
        rank=0,
        world_size=1,
        step=1,
        params={"w": (2,)},
        pieces=[whole("w", grad=torch.ones(2))],
        clip=ClipRecord(max_norm=1.0),
    )


@pytest.mark.parametrize("command", ["show", "check"])
def test_a_temporary_left_by_a_killed_writer_is_mentioned_but_not_an_error(tmp_path, capsys, command):
    step_dir = write_valid_step(tmp_path / "step_7")
    leftover = step_dir / f"{temporary_prefix('rank_00001.safetensors')}{_dead_pid()}-0a1b2c3d4e5f0"
    leftover.write_bytes(b"\0" * 4096)
    outcome = run_cli(capsys, command, str(step_dir))
    assert outcome.code == 0, outcome.stderr
    mentioned = "".join((outcome.stdout + outcome.stderr).split())
    assert leftover.name in mentioned and "unfinishedtemporaryfile(4,096bytes)" in mentioned


def test_the_writer_removes_its_own_stale_temporary_and_nobody_elses(tmp_path):
    step_dir = tmp_path / "step_1"
    step_dir.mkdir()
    mine = temporary_prefix("rank_00000.safetensors")
    stale = step_dir / f"{mine}{_dead_pid()}-0a1b2c3d4e5f0"
    running = step_dir / f"{mine}{os.getppid()}-0a1b2c3d4e5f0"
    other_host = step_dir / f".rank_00000.safetensors.tmp-elsewhere-{_dead_pid()}-0a1b2c3d4e5f0"
    other_rank = step_dir / f"{temporary_prefix('rank_00001.safetensors')}{_dead_pid()}-0a1b2c3d4e5f0"
    for path in (stale, running, other_host, other_rank):
        path.write_bytes(b"partial")
    _write_rank_0(step_dir)
    assert not stale.exists()
    assert running.exists() and other_host.exists() and other_rank.exists()


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_dump_is_written_with_the_mode_the_umask_gives(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        path = _write_rank_0(tmp_path / "step_1")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == mode
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_a_small_file_claiming_two_to_the_twenty_ranks_gives_a_short_json_report(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    rank_path(step_dir, 1).unlink()
    edit_metadata(rank_path(step_dir, 0), lambda doc: doc.__setitem__("world_size", 2**20))
    assert rank_path(step_dir, 0).stat().st_size < 2048
    outcome = run_cli(capsys, "check", str(step_dir), "--format", "json")
    assert outcome.code == 1, outcome.stderr
    assert len(outcome.stdout) < 20_000
    report = json.loads(outcome.stdout)
    assert report["missing_ranks"] == [[1, 2**20 - 1]] and report["ranks_present"] == [[0, 0]]
    assert next(f for f in report["findings"] if f["code"] == "GA100")["ranks"] == [[1, 2**20 - 1]]


def test_a_header_of_millions_of_empty_objects_is_refused_before_it_is_parsed(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    edit_metadata(rank_path(step_dir, 0), lambda doc: doc["clip"].__setitem__("calls", [{}] * 2_000_000))
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_clean_refusal(
        outcome,
        names=rank_path(step_dir, 0).name,
        problem="lists and objects in .* more than one per 8 bytes",
    )


def test_more_clip_calls_than_any_step_makes_are_refused(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    call = {"reported_norm": 1.0, "max_norm": 1.0, "norm_type": 2.0, "unscaled": True, "loss_scale": 1.0}
    edit_metadata(rank_path(step_dir, 0), lambda doc: doc["clip"].__setitem__("calls", [call] * 10_001))
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_clean_refusal(
        outcome, names=rank_path(step_dir, 0).name, problem="clip.calls: has 10001 entries, more than 10000"
    )
