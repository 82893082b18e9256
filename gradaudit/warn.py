"""Warnings given once per process and kind: a failing disk during capture does not flood logs."""

from __future__ import annotations

import warnings
from types import FrameType


class CaptureWarning(UserWarning):
    """gradaudit could not capture or write something; training goes on without it."""


_already_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn with `message` unless a warning with this `key` was already given in this process."""
    if key in _already_warned:
        return
    _already_warned.add(key)
    warnings.warn(message, CaptureWarning, stacklevel=_caller_stacklevel())


def _caller_stacklevel() -> int:
    """The stacklevel of the first frame outside gradaudit, so that a warning names the user's line."""
    import sys

    package = __name__.split(".")[0] + "."
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def forget_warnings() -> None:
    """Let every warning be given again (tests; a long job that wants a reminder)."""
    _already_warned.clear()
