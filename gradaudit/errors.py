"""The one family of user-facing errors; the CLI turns them into exit code 2."""

from __future__ import annotations

from typing import Any


def clipped(text: str, limit: int = 120) -> str:
    """Untrusted text cut to `limit` characters, so that one error stays one short line."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: Any, limit: int = 60) -> str:
    """repr() of an untrusted value, clipped."""
    return clipped(repr(value), limit)


class GradauditError(Exception):
    """A problem with what the user gave us (a dump, a path, an argument), with a next step."""


class DumpFormatError(GradauditError):
    """A dump file that cannot be trusted: it names the file and what is wrong with it."""

    def __init__(self, path: object, problem: str, hint: str = "") -> None:
        self.path = str(path)
        self.problem = problem
        self.hint = hint
        text = f"{self.path}: {problem}"
        if hint:
            text += f" ({hint})"
        super().__init__(text)

    def __reduce__(self) -> tuple[type[DumpFormatError], tuple[str, str, str]]:
        """Rebuilt from its fields, not its message alone (the scaled-out check sends it across processes)."""
        return type(self), (self.path, self.problem, self.hint)


class StepFolderError(GradauditError):
    """A step folder (or a folder of steps) that cannot be audited as a whole."""


class CaptureError(GradauditError):
    """A mistake in how the training code called the capture API."""


class UsageError(GradauditError):
    """A command-line or API argument that makes no sense."""
