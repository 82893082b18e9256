"""The check's progress bar: only on a terminal, only after a second, never in JSON output."""

from __future__ import annotations

import io
import sys
from pathlib import Path

from gradaudit.progress import DelayedProgress, check_progress


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_check_shorter_than_a_second_never_draws_the_bar():
    clock, terminal = Clock(), FakeTerminal()
    bar = DelayedProgress(terminal, clock=clock)
    for done in range(1, 11):
        clock.now = done * 0.09
        bar(done, 10)
    bar.close()
    assert not bar.shown and terminal.getvalue() == ""


def test_a_longer_check_draws_the_bar_once_it_has_lasted_a_second_and_keeps_one_bar_over_the_steps():
    clock, terminal = Clock(), FakeTerminal()
    bar = DelayedProgress(terminal, clock=clock)
    bar(1, 8)
    assert not bar.shown
    clock.now = 1.5
    bar(2, 8)
    assert bar.shown
    bar(5, 8)  # the second step of a two-step folder, counted on from the first (audit._over_steps)
    (task,) = bar._bar.tasks
    assert task.total == 8 and task.completed == 5
    bar.close()
    assert "measuring parameters" in terminal.getvalue()


def test_no_bar_when_stdout_or_stderr_is_not_a_terminal_or_the_output_is_json(monkeypatch):
    monkeypatch.setattr(sys, "stdout", FakeTerminal())
    with check_progress(enabled=True, stream=io.StringIO()) as progress:
        assert progress is None
    with check_progress(enabled=False, stream=FakeTerminal()) as progress:
        assert progress is None
    with check_progress(enabled=True, stream=FakeTerminal()) as progress:
        assert isinstance(progress, DelayedProgress)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    with check_progress(enabled=True, stream=FakeTerminal()) as progress:
        assert progress is None


SAMPLE = Path(__file__).resolve().parents[2] / "sample_dumps" / "fsdp2_correct" / "step_1"


def _check_on_a_terminal(monkeypatch, output_format: str) -> tuple[str, str]:
    from gradaudit import progress as progress_module
    from gradaudit.cli import main

    monkeypatch.setattr(progress_module, "SHOW_AFTER_S", 0.0)
    monkeypatch.setattr(sys, "stdout", FakeTerminal())
    monkeypatch.setattr(sys, "stderr", FakeTerminal())
    try:
        main(["check", str(SAMPLE), "--format", output_format])
    except SystemExit as exc:
        assert exc.code == 0, sys.stderr.getvalue()
    return sys.stdout.getvalue(), sys.stderr.getvalue()


def test_a_terminal_check_shows_the_bar_on_stderr_and_a_json_check_never(monkeypatch):
    out, err = _check_on_a_terminal(monkeypatch, "terminal")
    assert "measuring parameters" in err and "measuring parameters" not in out
    out, err = _check_on_a_terminal(monkeypatch, "json")
    assert out.lstrip().startswith("{") and "measuring" not in out + err
