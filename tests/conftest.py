from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from cli_runner import Outcome

os.environ.setdefault("COLUMNS", "100")


def pytest_addoption(parser):
    parser.addoption(
        "--update-goldens",
        action="store_true",
        default=False,
        help="rewrite the golden files in tests/golden/ from the current renderers (review the diff before committing)",
    )


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Outcome]:
    """`cli("check", step_dir)` runs gradaudit in-process and returns Outcome(code, stdout, stderr)."""
    from cli_runner import run_cli  # here, so that COLUMNS above is set before gradaudit is imported

    return functools.partial(run_cli, capsys)
