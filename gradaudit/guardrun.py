"""A guarded run's folder (gradaudit.guard's out_dir): its trend file read into the report's value,
beside the dumps and full captures `audit` audits; what `check` and `show` read of any folder."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .audit import Progress, Shares, audit_folder, audit_steps, run_step_dirs
from .live.trend import TREND_FILE, read_trend
from .live.writing import FULL_CAPTURES
from .report.model import GuardTrend, TrendStep, guard_trend

if TYPE_CHECKING:
    from .checks.base import AuditOptions
    from .report.model import MultiStepReport, Report

_TREND_LINE_FIELDS = tuple(f.name for f in fields(TrendStep) if f.name != "dump")
"""What a TrendStep takes from the trend file's TrendLine, under the same names (`dump`: the run folder's)."""


def is_guarded_run(path: str | Path) -> bool:
    """Whether `path` is a guarded run's folder: it holds the guard's trend, and is no step folder."""
    from .dumpfile.writer import RANK_FILE_SUFFIX

    path = Path(path)
    return (path / TREND_FILE).is_file() and not any(path.glob(f"*{RANK_FILE_SUFFIX}"))


def step_dirs_of(path: str | Path) -> list[Path]:
    """The step folders to read (see audit.run_step_dirs); none for a guarded run's folder that holds
    only the trend (the guard dumps only what it finds wrong)."""
    path = Path(path)
    step_dirs = run_step_dirs(path)
    return [d for d in step_dirs if d != path] if is_guarded_run(path) else step_dirs


def audit_run(
    path: str | Path,
    options: AuditOptions,
    *,
    progress: Progress | None = None,
    shares: Shares | None = None,
) -> Report | MultiStepReport:
    """`audit.audit_folder`, and of a guarded run's folder the MultiStepReport of its dumps (none or
    more) with the guard's trend, read first (a damaged trend stops the check before any audit)."""
    if not is_guarded_run(path):
        return audit_folder(path, options, progress=progress, shares=shares)
    step_dirs = step_dirs_of(path)
    trend = read_guard_trend(path, step_dirs)
    return replace(audit_steps(path, step_dirs, options, progress=progress, shares=shares), guard_trend=trend)


def read_guard_trend(path: str | Path, step_dirs: Sequence[Path]) -> GuardTrend | None:
    """The trend of a guarded run's folder (None without a trend file), its failing steps matched
    with the guard's dumps among `step_dirs`."""
    from .dumpfile.writer import STEP_DIR_PREFIX

    path = Path(path)
    if not is_guarded_run(path):
        return None
    dumps: dict[int, str] = {}
    full: list[str] = []
    for directory in step_dirs:
        number = directory.name.removeprefix(STEP_DIR_PREFIX)
        if directory.parent == path / FULL_CAPTURES:
            full.append(str(directory))
        elif directory.parent == path and number.isdigit():
            dumps[int(number)] = str(directory)
    file = path / TREND_FILE
    trend = read_trend(file)
    steps = (TrendStep(**{name: getattr(line, name) for name in _TREND_LINE_FIELDS}) for line in trend.lines)
    return guard_trend(
        steps, file=str(file), dumps=dumps, full_captures=full, num_unread=trend.num_unread, notes=trend.notes
    )
