"""Where the guard writes, and how it survives not being able to: the trend appended line by line
(a line cut short by an earlier attempt is dropped before appending), and the folder of this attempt's
dumps (a restart into the same out_dir writes beside the earlier attempt's dumps, never over them)."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import IO

FULL_CAPTURES = "full"
"""The guard's subfolder of full captures (the step after each anomaly), beside its step_<N> dumps."""
ATTEMPT_PREFIX = "attempt_"
"""A guarded run restarted into the same folder writes its dumps into attempt_<N>/ (N from 2)."""
_ATTEMPT = re.compile(rf"^{ATTEMPT_PREFIX}(\d+)$")
_STEP = re.compile(r"^step_\d+$")


def earlier_attempts(out_dir: Path) -> int:
    """How many attempts of a guarded run already wrote dumps into `out_dir` (0: none)."""
    try:
        names = [entry.name for entry in out_dir.iterdir()]
    except OSError:
        return 0
    numbers = [int(m.group(1)) for name in names if (m := _ATTEMPT.match(name))]
    if any(_STEP.match(name) for name in names) or FULL_CAPTURES in names:
        numbers.append(1)
    return max(numbers, default=0)


def attempt_folder(out_dir: Path, earlier: int) -> Path:
    """Where this attempt writes its dumps, `earlier` attempts having written theirs into out_dir."""
    return out_dir if earlier == 0 else out_dir / f"{ATTEMPT_PREFIX}{earlier + 1}"


class TrendAppender:
    """Appends lines to the trend file, opening it when first needed and again after a failure."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def append(self, text: str) -> None:
        """Append one line (raises OSError; the next call opens the file again)."""
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                _drop_cut_line(self.path)
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115  kept open between steps
            self._file.write(text + "\n")
            self._file.flush()
        except OSError:
            self.close()
            raise

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # what could not be flushed is lost, already warned about
                file.close()


def _drop_cut_line(path: Path) -> None:
    """Cut a last line without its newline (a write that ran out of disk) off the end of `path`."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return
    if size == 0:
        return
    with open(path, "rb+") as file:
        end = size
        while end > 0:
            start = max(0, end - 65536)
            file.seek(start)
            chunk = file.read(end - start)
            if end == size and chunk.endswith(b"\n"):
                return
            at = chunk.rfind(b"\n")
            if at >= 0:
                file.truncate(start + at + 1)
                return
            end = start
        file.truncate(0)
        os.fsync(file.fileno())
