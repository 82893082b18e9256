"""Guard trend files written by hand, for the tests that read or report them."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from gradaudit.live import trend
from gradaudit.live.trend import TREND_FILE, TrendLine


def skipped_line(step: int) -> TrendLine:
    """A step the scaler skipped: an infinite reported norm, nothing to check."""
    return trend.skipped_line(step, math.inf)


def write_trend(folder: Path, lines: Iterable[TrendLine]) -> Path:
    """`folder` (made if missing) holding a trend file of `lines`, one JSON object each."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TREND_FILE).write_text("".join(json.dumps(line.to_json()) + "\n" for line in lines))
    return folder


def clipped_line(
    step: int, *, codes: tuple[str, ...] = (), true: float = 1.2, reported: float = 1.2
) -> TrendLine:
    """A step clipped with max_norm 1 by the norm it reported (1 when no rank clipped)."""
    applied = min(1.0, 1 / (reported + 1e-6))
    return TrendLine(
        step=step,
        true_norm=true,
        reported_norm=reported,
        expected_coef=min(1.0, 1 / (true + 1e-6)),
        min_coef=applied,
        max_coef=applied,
        codes=codes,
    )
