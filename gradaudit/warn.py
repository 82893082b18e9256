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
    return user_stacklevel(2, (__name__.split(".")[0],))


def user_stacklevel(warner: int, packages: tuple[str, ...]) -> int:
    """The stacklevel, for the `warnings.warn` of the function `warner` frames up from this one, of
    the first frame outside `packages` (top-level names): the user's line that led there."""
    import sys

    prefixes = tuple(p + "." for p in packages)
    frame: FrameType | None = sys._getframe(warner + 1)
    level = 2
    while frame is not None:
        name = str(frame.f_globals.get("__name__", ""))
        if not (name in packages or name.startswith(prefixes)):
            break
        frame, level = frame.f_back, level + 1
    return level


def forget_warnings() -> None:
    """Let every warning be given again (tests; a long job that wants a reminder)."""
    _already_warned.clear()
