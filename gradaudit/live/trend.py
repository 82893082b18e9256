"""The guard's trend file: one JSON line per checked step, appended by rank 0, and its reading for
`gradaudit check` (failing steps first, then the true vs reported norm over the steps). No torch."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import StepFolderError

if TYPE_CHECKING:
    from ..report.model import Report
    from .analysis_input import LiveStep

TREND_FILE = "guard_trend.jsonl"
MAX_TREND_LINES = 1_000_000
"""A bound on what is read back (the file is the guard's own, but may be any size after a long run)."""
BAR_WIDTH = 40
SHOWN_STEPS = 12


@dataclass(frozen=True, kw_only=True)
class TrendLine:
    """One checked step as the guard judged it."""

    step: int
    true_norm: float | None
    reported_norm: float | None
    """What the clip call returned on rank 0 (None: no clip call). With several calls, this, `true_norm`
    and `expected_coef` are the first call's (see report.model.first_call_numbers)."""
    expected_coef: float | None
    min_coef: float | None
    max_coef: float | None
    """The smallest and largest coefficient the ranks applied (the last clip call's); their difference
    is the spread."""
    codes: tuple[str, ...] = ()
    """The error codes of the step; empty when its clipping was right."""
    skipped: bool = False
    """Every rank's GradScaler skipped the step (inf gradients): not checked, and not an anomaly."""
    clip_calls: int = 1
    """The most clip calls a rank made in the step (GA501 above 1), when the true norm before each is known."""

    @property
    def ok(self) -> bool:
        return not self.codes

    @property
    def coef_spread(self) -> float | None:
        if self.min_coef is None or self.max_coef is None:
            return None
        return self.max_coef - self.min_coef

    def metrics(self, prefix: str = "gradaudit/") -> dict[str, float]:
        """What the integrations log through the framework's logger: the true norm, and the reported
        norm over it (1.0 when the clip used the true norm); empty when the step had no true norm."""
        if self.true_norm is None or not math.isfinite(self.true_norm):
            return {}
        logged = {f"{prefix}true_norm": self.true_norm}
        if self.reported_norm is not None and self.true_norm > 0:
            logged[f"{prefix}reported_over_true"] = self.reported_norm / self.true_norm
        return logged

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "true_norm": _finite_or_text(self.true_norm),
            "reported_norm": _finite_or_text(self.reported_norm),
            "expected_coef": _finite_or_text(self.expected_coef),
            "min_coef": _finite_or_text(self.min_coef),
            "max_coef": _finite_or_text(self.max_coef),
            "coef_spread": _finite_or_text(self.coef_spread),
            "verdict": "skipped" if self.skipped else "ok" if self.ok else "anomaly",
            "codes": list(self.codes),
        } | ({"clip_calls": self.clip_calls} if self.clip_calls > 1 else {})


def _finite_or_text(value: float | None) -> float | str | None:
    """JSON has no nan or inf: they are written as the strings "nan", "inf", "-inf"."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def _number(doc: Mapping[str, Any], key: str, where: str) -> float | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    return float(value)


def trend_line(report: Report, codes: tuple[str, ...]) -> TrendLine:
    """The trend line of a step from its report; its norms and expected coefficient are those the
    run's summary row shows (with several clip calls, GA501, the first call's)."""
    from ..report.model import first_call_numbers

    coefs = [r.applied_clip_coef for r in report.ranks if r.applied_clip_coef is not None]
    numbers = first_call_numbers(report)
    return TrendLine(
        step=report.step,
        true_norm=numbers.true_norm,
        reported_norm=numbers.reported_norm,
        expected_coef=numbers.expected_clip_coef,
        min_coef=min(coefs) if coefs else None,
        max_coef=max(coefs) if coefs else None,
        codes=codes,
        clip_calls=numbers.clip_calls,
    )


def skipped_line(live: LiveStep) -> TrendLine:
    """The trend line of a step every rank's GradScaler skipped: the norm the first clip call returned."""
    reported = next((c.reported_norm for r in live.ranks.values() for c in r.calls), None)
    return TrendLine(
        step=live.step,
        true_norm=None,
        reported_norm=reported,
        expected_coef=None,
        min_coef=None,
        max_coef=None,
        skipped=True,
    )


def read_trend(path: str | Path) -> list[TrendLine]:
    """The lines of a trend file, in file order; a malformed line is a StepFolderError naming it."""
    path = Path(path)
    lines = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, text in enumerate(handle, start=1):
                if number > MAX_TREND_LINES:
                    break
                if not text.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    doc = json.loads(text)
                    if not isinstance(doc, dict):
                        raise ValueError(f"{where}: not a JSON object")
                    step = doc.get("step")
                    if isinstance(step, bool) or not isinstance(step, int):
                        raise ValueError(f"{where}: step must be an integer")
                    codes = doc.get("codes", [])
                    if not isinstance(codes, list) or not all(isinstance(c, str) for c in codes):
                        raise ValueError(f"{where}: codes must be a list of strings")
                    calls = doc.get("clip_calls", 1)
                    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
                        raise ValueError(f"{where}: clip_calls must be a positive integer")
                    lines.append(
                        TrendLine(
                            step=step,
                            true_norm=_number(doc, "true_norm", where),
                            reported_norm=_number(doc, "reported_norm", where),
                            expected_coef=_number(doc, "expected_coef", where),
                            min_coef=_number(doc, "min_coef", where),
                            max_coef=_number(doc, "max_coef", where),
                            codes=tuple(codes),
                            skipped=doc.get("verdict") == "skipped",
                            clip_calls=calls,
                        )
                    )
                except ValueError as exc:  # json.JSONDecodeError is a ValueError
                    raise StepFolderError(
                        f"{exc if str(exc).startswith(str(path)) else f'{where}: {exc}'}; "
                        f"the guard's trend file is damaged: remove the line or the file"
                    ) from None
    except OSError as exc:
        raise StepFolderError(f"{path}: cannot read the guard's trend file ({exc.strerror or exc})") from None
    return lines


def trend_text(lines: Sequence[TrendLine]) -> str:
    """Plain text: the failing steps first, then true vs reported norm of the last checked steps."""
    out = []
    failing = [line for line in lines if not line.ok]
    out.append(
        f"guard trend: {len(lines)} checked step{'s' if len(lines) != 1 else ''}, "
        f"{len(failing)} with wrong clipping"
    )
    out.extend(
        f"  step {line.step}: {', '.join(line.codes)}{_numbers(line)}" for line in failing[:SHOWN_STEPS]
    )
    if len(failing) > SHOWN_STEPS:
        out.append(f"  (and {len(failing) - SHOWN_STEPS} more failing steps)")
    shown = list(lines)[-SHOWN_STEPS:]
    top = max(
        (
            v
            for line in shown
            for v in (line.true_norm, line.reported_norm)
            if v is not None and math.isfinite(v)
        ),
        default=0.0,
    )
    if shown and top > 0:
        out.append("  true (#) vs reported (|) norm, last checked steps:")
        out.extend(
            f"  {line.step:>8} {_bar(line.true_norm, line.reported_norm, top)} {_pair(line)}"
            for line in shown
        )
    return "\n".join(out)


def _bar(true: float | None, reported: float | None, top: float) -> str:
    cells = [" "] * BAR_WIDTH
    for value, mark in ((true, "#"), (reported, "|")):
        if value is None or not math.isfinite(value):
            continue
        filled = min(BAR_WIDTH, round(BAR_WIDTH * value / top))
        if mark == "#":
            cells[:filled] = ["#"] * filled
        elif filled > 0:
            cells[filled - 1] = "|"
    return "".join(cells)


def _pair(line: TrendLine) -> str:
    mark = "  skipped by the scaler" if line.skipped else "" if line.ok else "  " + ",".join(line.codes)
    return f"{_fmt(line.true_norm)} / {_fmt(line.reported_norm)}{mark}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _numbers(line: TrendLine) -> str:
    parts = [f"true norm {_fmt(line.true_norm)}", f"reported {_fmt(line.reported_norm)}"]
    if line.coef_spread is not None:
        by = f" applied{by_last_call(line)}" if line.clip_calls > 1 else ""
        parts.append(f"coefficients{by} {_fmt(line.min_coef)}..{_fmt(line.max_coef)}")
    return " (" + ", ".join(parts) + ")"


def by_last_call(line: TrendLine) -> str:
    """With several clip calls, that the coefficients are the last one's (only its is measured)."""
    return "" if line.clip_calls == 1 else f" by the last of {line.clip_calls} clip calls"
