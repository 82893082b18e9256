"""Running the real CLI in-process: its exit code and what it printed, for the `cli` fixture."""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest

from gradaudit.cli import main


class Outcome(NamedTuple):
    code: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str | os.PathLike[str]) -> Outcome:
    """`gradaudit ARGV...` in this process; only what this call printed is in the outcome."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    code = exited.value.code
    return Outcome(code=0 if code is None else code, stdout=captured.out, stderr=captured.err)
