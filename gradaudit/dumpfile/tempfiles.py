"""The writer's temporary files: names no restart can repeat, created exclusively, and the leftovers of
killed writers found and removed once their writer is provably gone."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from pathlib import Path

TEMPORARY_MARK = ".tmp-"
"""A file being written is `.<final name>.tmp-<host>-<pid>-<token>` until it is complete."""

_PROCESS_TOKEN = os.urandom(6).hex()
"""Random per process: a restarted job often gets the same pid on the same host (containers), and
must neither take an earlier process's temporary for its own nor collide with its name."""
_serial = itertools.count()
_SAFETENSORS_TEMPORARY = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")
"""The hidden temporary the safetensors library's save_file writes beside its target (Rust tempfile
crate); gradaudit 0.1.0 wrote rank files through it, so a writer killed then left one here."""


def _host() -> str:
    import socket  # only writers name temporaries: a check of a dump never loads it

    return "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())[:64]


def temporary_prefix(final_name: str) -> str:
    """What every temporary of `final_name` written on this host starts with."""
    return f".{final_name}{TEMPORARY_MARK}{_host()}-"


def temporary_name(final_name: str) -> str:
    """A fresh temporary name for `final_name`: never the same twice, in this process or any other."""
    return f"{temporary_prefix(final_name)}{os.getpid()}-{_PROCESS_TOKEN}{next(_serial):x}"


def is_temporary(name: str) -> bool:
    """Whether a file name is a writer's temporary (complete or not): gradaudit's own, of a rank file
    or a shared parameter table, or the safetensors library's of a gradaudit 0.1.0 writer."""
    own = name.startswith((".rank_", ".params_")) and TEMPORARY_MARK in name
    return own or _SAFETENSORS_TEMPORARY.match(name) is not None


def create_exclusively(path: Path) -> int:
    """Create `path` for writing, failing if anything has that name; the mode is the umask's (0666
    less the umask), as for any new file. Returns the descriptor."""
    return os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | getattr(os, "O_CLOEXEC", 0), 0o666)


def remove_stale_temporaries(directory: Path, final_name: str) -> None:
    """Remove the temporaries of `final_name` that a killed writer on this host left: those of a pid
    no longer running, and those of this pid that this process did not create (an earlier process
    with the same pid: a restart). A temporary of a live process, or of another host, is left alone."""
    prefix = temporary_prefix(final_name)
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid_text, _, token = name[len(prefix) :].partition("-")
        if not pid_text.isdigit():
            continue
        pid = int(pid_text)
        mine = token.startswith(_PROCESS_TOKEN)
        if (not mine and pid == os.getpid()) or (pid != os.getpid() and not _alive(pid)):
            with contextlib.suppress(OSError):
                os.unlink(directory / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, owned by someone else
    return True
