"""Running `python -m gradaudit` as the processes of a scaled-out check (the environment torchrun
gives them, each its own process) and as one process, for the scale-out tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], world_size: int = 2) -> list[subprocess.CompletedProcess]:
    """`python -m gradaudit ARGS` in `world_size` processes with the environment torchrun gives them;
    a process still running after TIMEOUT_S fails the test (a hung exchange)."""
    port = free_port()
    processes = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "gradaudit", *args],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    results = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return results


def single_process(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "gradaudit", *args], env=env, cwd=REPO, capture_output=True, timeout=TIMEOUT_S
    )
