"""Running the real CLI in-process and judging its answer to hostile input."""

from __future__ import annotations

import contextlib
import re
import signal
from collections.abc import Iterator

import pytest
from cli_runner import Outcome
from cli_runner import run_cli as _run_cli

COMMANDS = ("show", "check")


@contextlib.contextmanager
def no_hang(seconds: int = 60) -> Iterator[None]:
    """Turn a hang (say, blocking on a named pipe) into a test failure instead of a stuck suite."""

    def expired(signum, frame):
        raise TimeoutError(f"gradaudit gave no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> Outcome:
    """The `cli` fixture's run, which a hang fails instead of stalling the suite."""
    with no_hang():
        return _run_cli(capsys, *args)


def assert_clean_refusal(outcome: Outcome, *, names: str, problem: str) -> str:
    """Exit 2, nothing on stdout, and exactly one stderr line naming `names` and matching `problem`."""
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.code == 2, (outcome.code, outcome.stderr)
    assert outcome.stdout == ""
    assert len(outcome.stderr_lines) == 1, outcome.stderr
    line = outcome.stderr_lines[0]
    assert line.startswith("error: ") and names in line, line
    assert re.search(problem, line), f"{problem!r} not in {line!r}"
    return line


def assert_report_or_clean_refusal(outcome: Outcome) -> None:
    """The only acceptable answers to any input: a report (exit 0/1) or a one-line refusal (exit 2)."""
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert outcome.code in (0, 1, 2), (outcome.code, outcome.stderr)
    if outcome.code == 2:
        assert len(outcome.stderr_lines) == 1 and outcome.stderr.startswith("error: "), outcome.stderr
