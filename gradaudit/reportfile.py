"""Where `check --output` may write its report, and writing it there without touching any other file."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from .errors import UsageError

_MAX_DEPTH = 3
"""A run folder holds step folders, a reference folder its step folder: the dump files lie at most
this deep below a folder `check` is given."""


def refuse_output_path(output: Path, dump_dirs: Sequence[Path]) -> None:
    """The report may go anywhere the user names, except over a folder or onto a dump being read:
    inside a dump folder (through symlinks too), or onto a file that is one of the dump's files under
    another name (a hard link: the same device and inode)."""
    if output.is_dir():
        raise UsageError(f"{output}: --output names a folder; give a file name such as report.md")
    target = output.resolve()
    for folder in dump_dirs:
        root = folder.resolve()
        if target == root or root in target.parents:
            raise UsageError(
                f"{output}: --output lies inside the dump folder {folder}; write the report elsewhere"
            )
    try:
        found = os.stat(output)
    except OSError:
        return  # nothing there yet: it cannot be a dump file
    if found.st_nlink <= 1 or not stat.S_ISREG(found.st_mode):
        return  # a file with one name is no other file's second name
    for folder in dump_dirs:
        same = _file_with_identity(folder, (found.st_dev, found.st_ino), _MAX_DEPTH)
        if same is not None:
            raise UsageError(
                f"{output}: --output is another name (a hard link) of {same}, a file of the dump being "
                "read; write the report elsewhere"
            )


def _file_with_identity(folder: Path, identity: tuple[int, int], depth: int) -> Path | None:
    """A file at most `depth` levels below `folder` with this (device, inode), without following links."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return None
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_dir(follow_symlinks=False):
                if depth > 1 and (found := _file_with_identity(Path(entry.path), identity, depth - 1)):
                    return found
            elif entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                if (info.st_dev, info.st_ino) == identity:
                    return Path(entry.path)
    return None


def write_report_file(output: Path, text: str) -> None:
    """Write `text` to `output` through a temporary in the same folder, flushed to disk and renamed
    into place, so that the old report stays whole until the new one is (a failed write, a signal, a
    crash), and no other name of the old file (a hard link) is changed. The temporary is removed
    whatever stops the write: the CLI turns SIGINT and SIGTERM into exceptions, so this `finally` runs.
    A symlink is followed to the file it names; a pipe or device (say /dev/stdout) is written to directly."""
    from .dumpfile.tempfiles import create_exclusively, temporary_name

    data = text.encode("utf-8")
    target = Path(os.path.realpath(output))
    try:
        existing: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        target.write_bytes(data)
        return
    temporary = target.with_name(temporary_name(target.name))  # no other process's: pid and a token
    try:
        with os.fdopen(create_exclusively(temporary), "wb") as handle:
            handle.write(data)
            if existing is not None:
                os.fchmod(handle.fileno(), stat.S_IMODE(existing.st_mode))
            handle.flush()
            os.fsync(handle.fileno())  # else a crash after the rename may leave an empty report
        os.replace(temporary, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
