"""Running `gradaudit check` in-process on the committed sample dumps, for the sample tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_runner import run_cli

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "sample_dumps"


def step_dir(scenario: str, root: Path = SAMPLES) -> Path:
    return root / scenario / "step_1"


def reference_dir(scenario: str, root: Path = SAMPLES) -> Path:
    return root / scenario / "reference" / "step_1"


def check_json(capsys: pytest.CaptureFixture, step: Path, reference: Path | None = None) -> dict:
    """The JSON report of `gradaudit check STEP [--reference REF]`; exit code 0 or 1 is required."""
    argv = ["check", str(step), "--format", "json"]
    if reference is not None:
        argv += ["--reference", str(reference)]
    code, out, err = run_cli(capsys, *argv)
    assert code in (0, 1), err
    return json.loads(out)


def codes(report: dict, severity: str | None = None) -> list[str]:
    return sorted(f["code"] for f in report["findings"] if severity is None or f["severity"] == severity)
