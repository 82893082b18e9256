"""bench/startup.py keeps running and prints its TARGET lines (no timing asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_startup_bench_times_every_subject_and_prints_a_target_line_for_each_target() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "startup.py"), "--repeats", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
        check=True,
    )
    targets = re.findall(r"^TARGET (.+): (MET|MISSED by \d+%) \(", done.stdout, re.M)
    assert [label for label, _ in targets] == [
        "--help vs typer+rich floor",
        "explain vs typer+rich floor",
        "check sample vs numpy+typer+rich floor",
        "check sample wall seconds (idle machine)",
    ], done.stdout


def test_startup_subjects_read_gradaudit_from_a_bytecode_cache_and_floors_get_gradaudits_blas_threads(
    monkeypatch,
) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import startup
    finally:
        sys.path.remove(str(REPO / "bench"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    env = startup.subject_env()
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPATH"] == str(REPO)
    assert env["OPENBLAS_NUM_THREADS"] == "1"
