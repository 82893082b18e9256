"""Comparing a rendering with its committed golden file, or rewriting the file when asked to."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

RENDERER_GOLDENS = Path(__file__).parent / "golden"
"""Reports built by hand (tests/render/reports.py) and rendered in every format."""
SAMPLE_GOLDENS = Path(__file__).parent / "golden_samples"
"""The Markdown report of every committed sample dump."""


def updating(request: pytest.FixtureRequest) -> bool:
    """`--update-goldens` (or GRADAUDIT_UPDATE_GOLDENS=1): write the golden files instead of comparing."""
    try:
        flag = request.config.getoption("--update-goldens")
    except ValueError:  # run without tests/conftest.py, which declares the option
        flag = False
    return bool(flag) or os.environ.get("GRADAUDIT_UPDATE_GOLDENS") == "1"


def assert_golden(request: pytest.FixtureRequest, golden: Path, text: str) -> None:
    """`text` is the golden file's content byte for byte; a difference fails with a unified diff."""
    rerun = f"pytest {request.path.relative_to(request.config.rootpath)} --update-goldens"
    if updating(request):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text, encoding="utf-8", newline="\n")
        return
    assert golden.exists(), f"{golden} is missing; run `{rerun}`"
    expected = golden.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(
            difflib.unified_diff(expected.splitlines(True), text.splitlines(True), "golden", "now")
        )
        pytest.fail(
            f"{golden.name} differs from the golden file (if intended, run `{rerun}` and review):\n{diff}"
        )
