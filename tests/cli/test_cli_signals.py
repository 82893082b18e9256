"""`gradaudit check` stopped by SIGINT or SIGTERM: exit 130 or 143 with one line on stderr, and the
report file of `--output` is the old one or none, never part of one, with no temporary left behind."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import clean_step

from gradaudit import reportfile
from gradaudit.live.trend import TREND_FILE

REPO = Path(__file__).resolve().parents[2]
SLOW_TREND_LINES = 1_000_000
"""Short lines read one by one: a few seconds of reading on any machine for 11 MB on disk."""


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory):
    """A guarded run's folder with a clean step to report on, behind a trend that takes seconds to read."""
    folder = tmp_path_factory.mktemp("signals") / "run"
    clean_step(folder / "step_1")
    (folder / TREND_FILE).write_bytes(b'{"step":1}\n' * SLOW_TREND_LINES)
    return folder


def _reading(pid: int, path: Path, timeout_s: float = 60.0) -> bool:
    """Wait until process `pid` has `path` open (it is reading it); False if it exited first."""
    deadline = time.monotonic() + timeout_s
    fds = Path(f"/proc/{pid}/fd")
    while time.monotonic() < deadline:
        try:
            if any(os.readlink(fd) == str(path) for fd in fds.iterdir()):
                return True
        except FileNotFoundError:  # a descriptor closed while listed, or the process is gone
            if not fds.exists():
                return False
        time.sleep(0.005)
    return False


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to see the file being read")
@pytest.mark.parametrize("old_report", [b'{"old": "report"}\n', None], ids=["old report", "no report"])
@pytest.mark.parametrize(
    "signum, code, line",
    [(signal.SIGINT, 130, "gradaudit: interrupted"), (signal.SIGTERM, 143, "gradaudit: terminated")],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_stops_check_with_its_exit_code_and_one_line_and_leaves_the_old_report_or_none(
    tmp_path, slow_run, signum, code, line, old_report
):
    reports = tmp_path / "reports"
    reports.mkdir()
    output = reports / "report.json"
    if old_report is not None:
        output.write_bytes(old_report)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gradaudit",
            "check",
            str(slow_run),
            "--format",
            "json",
            "--output",
            str(output),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert _reading(process.pid, slow_run / TREND_FILE), process.communicate(timeout=60)
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert (process.returncode, err.decode(), out) == (code, line + "\n", b"")
    if old_report is None:
        assert list(reports.iterdir()) == []
    else:
        assert list(reports.iterdir()) == [output] and output.read_bytes() == old_report


def test_a_report_write_stopped_before_its_rename_keeps_the_old_report_and_leaves_no_temporary(
    tmp_path, monkeypatch
):
    output = tmp_path / "report.md"
    output.write_text("old report\n")

    def stopped(source, target):
        raise KeyboardInterrupt  # what a signal raises where the writer is

    monkeypatch.setattr(reportfile.os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        reportfile.write_report_file(output, "new report\n")
    assert list(tmp_path.iterdir()) == [output] and output.read_text() == "old report\n"


def test_a_report_that_cannot_be_flushed_to_disk_exits_2_and_keeps_the_old_report(tmp_path, monkeypatch, cli):
    step = clean_step(tmp_path / "step_1")
    reports = tmp_path / "reports"
    reports.mkdir()
    output = reports / "report.json"
    output.write_text("old report\n")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(reportfile.os, "fsync", full)
    handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    code, out, err = cli("check", step, "--format", "json", "--output", output)
    assert (code, out) == (2, "")
    assert err == f"error: {output}: cannot write the report (No space left on device)\n"
    assert list(reports.iterdir()) == [output] and output.read_text() == "old report\n"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
