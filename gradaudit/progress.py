"""A progress bar for long checks: rich, on stderr, transient, shown only after the first second."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

SHOW_AFTER_S = 1.0
"""Checks shorter than this never show a bar (it would only flicker)."""


class DelayedProgress:
    """A `progress(done, total)` callback that draws a transient bar once the work has lasted
    SHOW_AFTER_S. A run folder's steps share the one bar: the audit counts over all of them (see
    audit._over_steps), so the bar moves on from step to step instead of starting again."""

    def __init__(self, stream: TextIO, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._clock = clock
        self._started = clock()
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None or self._task is None:
            if self._clock() - self._started < SHOW_AFTER_S:
                return
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn("measuring parameters"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=Console(file=self._stream),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task("measure", total=total)
        self._bar.update(self._task, completed=done, total=total)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


@contextlib.contextmanager
def check_progress(*, enabled: bool, stream: TextIO | None = None) -> Iterator[DelayedProgress | None]:
    """The progress callback for `gradaudit check`, or None when `enabled` is false or either of
    stdout and stderr is not a terminal (a pipe, a file, CI logs)."""
    stream = sys.stderr if stream is None else stream
    if not (enabled and _is_tty(sys.stdout) and _is_tty(stream)):
        yield None
        return
    bar = DelayedProgress(stream)
    try:
        yield bar
    finally:
        bar.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
