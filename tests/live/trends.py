"""Guard trend files written by hand, for the tests that read or report them."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from gradaudit.live.trend import TREND_FILE, TrendLine


def skipped_line(step: int) -> TrendLine:
    """A step the scaler skipped: an infinite reported norm, nothing to check."""
    return TrendLine(
        step=step,
        true_norm=None,
        reported_norm=math.inf,
        expected_coef=None,
        min_coef=None,
        max_coef=None,
        skipped=True,
    )


def write_trend(folder: Path, lines: Iterable[TrendLine]) -> Path:
    """`folder` (made if missing) holding a trend file of `lines`, one JSON object each."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / TREND_FILE).write_text("".join(json.dumps(line.to_json()) + "\n" for line in lines))
    return folder
