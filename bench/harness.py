"""Running one measured subject in its own process, and reading its time and peak resident memory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

SUBJECTS_SCRIPT = Path(__file__).with_name("subjects.py")
MIB = 1 << 20
IN_PROCESS = False
"""Set by run.py --in-process: run subjects in the benchmark's own process (the smoke test)."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """One run of one subject: its own timing of its work, its process's peak RSS, and what it returned."""

    seconds: float | None
    peak_rss_bytes: int
    value: object = None
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class Summary:
    """Several runs of one subject: the median time, the largest peak RSS."""

    name: str
    runs: tuple[Run, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.error is None for r in self.runs)

    @property
    def error(self) -> str | None:
        return next((r.error for r in self.runs if r.error is not None), None)

    @property
    def seconds(self) -> float | None:
        return statistics.median(r.seconds for r in self.runs) if self.ok else None

    @property
    def peak_rss_bytes(self) -> int | None:
        return max(r.peak_rss_bytes for r in self.runs) if self.ok else None

    @property
    def value(self) -> object:
        return self.runs[-1].value if self.ok else None


def run_subject(name: str, args: dict, *, timeout_s: float = 900.0) -> Run:
    """Run `bench/subjects.py NAME ARGS` and wait for it with wait4, which gives this child's own rusage
    (RUSAGE_CHILDREN would give the maximum over every child so far)."""
    if IN_PROCESS:
        return _run_in_process(name, args)
    command = [sys.executable, str(SUBJECTS_SCRIPT), name, json.dumps(args)]
    with tempfile.TemporaryFile() as err:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=err, cwd=SUBJECTS_SCRIPT.parent, start_new_session=True
        )
        timer = threading.Timer(timeout_s, _kill_group, args=(process.pid,))
        timer.start()
        try:
            out = process.stdout.read()
            process.stdout.close()
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
        finally:
            timer.cancel()
        peak = usage.ru_maxrss * 1024  # kilobytes on Linux
        if process.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or [
                f"exit {process.returncode}"
            ]
            return Run(seconds=None, peak_rss_bytes=peak, error=tail[0][:300])
    result = json.loads(out.decode().strip().splitlines()[-1])
    return Run(seconds=result["seconds"], peak_rss_bytes=peak, value=result["value"])


def _run_in_process(name: str, args: dict) -> Run:
    """The subject in this process (the smoke test's fast path): its time is right, its peak RSS is
    this whole process's so far."""
    import resource

    import subjects

    try:
        seconds, value = subjects.measure(name, args)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported as the subject's failure
        return Run(seconds=None, peak_rss_bytes=0, error=f"{type(exc).__name__}: {exc}"[:300])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Run(seconds=seconds, peak_rss_bytes=peak, value=value)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def interleaved(subjects: dict[str, dict], repeats: int, **kw) -> dict[str, Summary]:
    """Run every subject once per round, `repeats` rounds, so that load from other processes on the
    machine spreads over all subjects alike; a subject that fails once is not run again.
    `subjects` maps a display name to the subject's arguments; "_subject" names the subject when it
    differs from the display name, "_repeats" caps its rounds."""
    runs: dict[str, list[Run]] = {name: [] for name in subjects}
    for round_ in range(repeats):
        for name, args in subjects.items():
            if runs[name] and runs[name][-1].error is not None:
                continue
            if round_ >= args.get("_repeats", repeats):
                continue
            runs[name].append(run_subject(args.get("_subject", name), _plain(args), **kw))
    return {name: Summary(name=name, runs=tuple(r)) for name, r in runs.items()}


def _plain(args: dict) -> dict:
    return {k: v for k, v in args.items() if not k.startswith("_")}


def warm_page_cache(directory: Path) -> None:
    """Read every file once, so that no subject pays the first read from disk."""
    for path in sorted(directory.iterdir()):
        with open(path, "rb") as handle:
            while handle.read(64 * MIB):
                pass
