"""Faults during capture: a pipe at the shared table's name, a writer killed by
SIGKILL mid-write, a job restarted with the same pid. Training is bit-identical to the same step
without gradaudit, and nothing the user had is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradaudit.dumpfile.paramtable import publish_table
from gradaudit.dumpfile.tempfiles import temporary_prefix

from .cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("fault_workers.py")


def _worker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, str(WORKER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _train(out_dir: Path | None, mode: str = "stats") -> dict:
    done = _worker("train_step", str(out_dir) if out_dir else "-", mode)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def _hidden(step_dir: Path) -> list[str]:
    return sorted(p.name for p in step_dir.iterdir() if p.name.startswith("."))


@pytest.fixture(scope="module")
def untouched() -> dict:
    """The parameters after the same step without gradaudit."""
    return _train(None)


def test_a_pipe_at_the_shared_tables_name_neither_blocks_nor_changes_training(tmp_path, untouched, capsys):
    first = _train(tmp_path / "first")
    assert first["params"] == untouched["params"]
    (table,) = (tmp_path / "first" / "step_1").glob("params_*.safetensors")
    step_dir = tmp_path / "second" / "step_1"
    step_dir.mkdir(parents=True)
    os.mkfifo(step_dir / table.name)
    second = _train(tmp_path / "second")  # a blocking open() of the pipe hung here, training with it
    assert second["params"] == untouched["params"]
    assert any(table.name in w and "not a regular file" in w for w in second["warnings"]), second
    outcome = run_cli(capsys, "check", str(step_dir))
    assert outcome.code == 0 and (step_dir / "rank_00000.safetensors").is_file(), outcome.stderr


def test_a_writer_killed_mid_write_leaves_only_its_own_temporary_which_is_mentioned_and_then_cleaned(
    tmp_path, capsys
):
    import torch

    from gradaudit.capture.build import whole, write_rank
    from gradaudit.model import ClipRecord

    step_dir = tmp_path / "step_1"
    write_rank(
        step_dir, rank=0, world_size=2, step=1, params={"w": (64,)}, pieces=[], clip=ClipRecord(max_norm=1.0)
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    writer = subprocess.Popen(
        [sys.executable, str(WORKER), "write_large_rank", str(step_dir), str(16 << 20)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and writer.poll() is None:
            sizes = [p.stat().st_size for p in step_dir.iterdir() if p.name.startswith(".")]
            if any(size >= 8 << 20 for size in sizes):
                break
            time.sleep(0.005)
        assert writer.poll() is None, writer.communicate()
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait()
    (leftover,) = _hidden(step_dir)  # no foreign `.tmpXXXXXX` holding the bytes
    assert leftover.startswith(temporary_prefix("rank_00001.safetensors"))
    size = (step_dir / leftover).stat().st_size
    assert size >= 8 << 20
    for command in ("show", "check"):
        outcome = run_cli(capsys, command, str(step_dir))
        said = "".join((outcome.stdout + outcome.stderr).split())
        assert leftover in said and f"unfinishedtemporaryfile({size:,}bytes)" in said, said
    write_rank(
        step_dir, rank=1, world_size=2, step=1, params={"w": (64,)}, pieces=[whole("w", grad=torch.ones(64))]
    )
    assert _hidden(step_dir) == []


def test_a_temporary_safetensors_itself_left_is_mentioned(tmp_path, capsys):
    from .corpus import write_valid_step

    step_dir = write_valid_step(tmp_path / "step_7")
    (step_dir / ".tmpAb3dE9").write_bytes(b"\0" * 1000)
    outcome = run_cli(capsys, "check", str(step_dir))
    assert outcome.code == 0
    said = "".join((outcome.stdout + outcome.stderr).split())
    assert ".tmpAb3dE9" in said and "unfinishedtemporaryfile(1,000bytes)" in said, said


@pytest.mark.parametrize("token", ["", "-0a1b2c3d4e5f0"], ids=["0.1.0-name", "earlier-process"])
def test_a_job_restarted_with_the_same_pid_writes_its_step_and_removes_the_earlier_leftover(
    tmp_path, untouched, token
):
    step_dir = tmp_path / "step_1"
    step_dir.mkdir()
    # What a killed predecessor with the same pid left: made by the training process itself, under
    # its own pid, before it trains.
    leftover_maker = (
        "import os, sys; from gradaudit.dumpfile.tempfiles import temporary_prefix; "
        "open(os.path.join(sys.argv[1], temporary_prefix('rank_00000.safetensors') "
        f"+ str(os.getpid()) + {token!r}), 'wb')"
    )
    restarted = _train_with_leftover(tmp_path, step_dir, leftover_maker)
    assert restarted["params"] == untouched["params"]
    assert restarted["warnings"] == [], restarted["warnings"]
    assert (step_dir / "rank_00000.safetensors").is_file()
    assert _hidden(step_dir) == []


def _train_with_leftover(tmp_path: Path, step_dir: Path, leftover_maker: str) -> dict:
    """One process that first leaves a temporary under its own pid (as a killed predecessor with the
    same pid would have), then trains the audited step."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    code = (
        f"import sys; sys.argv = ['x', {str(step_dir)!r}]; exec({leftover_maker!r}); "
        f"sys.path.insert(0, {str(WORKER.parent)!r}); import json, fault_workers; "
        f"print(json.dumps(fault_workers.train_step({str(tmp_path)!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_publishing_a_table_never_removes_a_temporary_it_did_not_create(tmp_path):
    theirs = tmp_path / ".params_0123456789abcdef.safetensors.tmp-host-1-0a1b2c3d4e5f0"
    theirs.write_bytes(b"another writer's bytes")
    assert publish_table(tmp_path, "params_0123456789abcdef.safetensors", b"table", theirs) is False
    assert theirs.read_bytes() == b"another writer's bytes"
