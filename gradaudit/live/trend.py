"""The guard's trend file: one JSON line per checked step, appended by rank 0, and its reading for
`gradaudit check` (failing steps first, then the true vs reported norm over the steps). No torch."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from ..errors import StepFolderError

if TYPE_CHECKING:
    from ..report.model import Report, TrendVerdict

TREND_FILE = "guard_trend.jsonl"
MAX_TREND_LINES = 1_000_000
"""A bound on what is read back (the file is the guard's own, but may be any size after a long run):
the newest lines of a longer file are read, the older ones counted."""
MAX_LINE_BYTES = 1 << 16
"""A trend line is a few hundred bytes; a longer one is damage, and is not read into memory."""
_CHUNK_BYTES = 1 << 20
_DECODER = json.JSONDecoder()


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
    is the spread. On a step the guard's sum settled (no per-rank numbers gathered), equal when every
    rank applied the same bits, else the bounds the summed distances give (within a quarter of the
    tolerance: see live/fastpath.py)."""
    codes: tuple[str, ...] = ()
    """The error codes of the step; empty when its clipping was right."""
    skipped: bool = False
    """Every rank's GradScaler skipped the step (inf gradients): not checked, and not an anomaly."""
    clip_calls: int = 1
    """The most clip calls a rank made in the step (GA501 above 1), when the true norm before each is known."""
    spike: bool = False
    """The step's true norm spiked (the guard's `spike=` rule): the guard dumped its per-parameter
    statistics. Written to the trend file only when set."""
    last_reported_norm: float | None = None
    """With several clip calls, what the last returned (on the lowest rank that reported one): the norm
    the gradients the optimizer stepped with were last clipped by. Logged (see `metrics`), not written
    to the trend file."""

    @property
    def ok(self) -> bool:
        return not self.codes

    @property
    def verdict(self) -> TrendVerdict:
        """ "skipped" (the scaler skipped the step), "ok" or "anomaly", as the trend file says it."""
        return "skipped" if self.skipped else "ok" if self.ok else "anomaly"

    @property
    def coef_spread(self) -> float | None:
        if self.min_coef is None or self.max_coef is None:
            return None
        return self.max_coef - self.min_coef

    def metrics(self, prefix: str = "gradaudit/", *, reported_norm: float | None = None) -> dict[str, float]:
        """What the integrations log through the framework's logger at this step; nothing for a step
        the scaler skipped (not checked):

        - `anomaly`: the number of the step's error codes, 0 when its clipping was right (an alert's
          trigger, logged on every checked step, whatever its norms);
        - `true_norm`: the true global norm, before the step's first clip call, as the warning and
          `gradaudit check`'s run table give it;
        - `reported_over_true`: the norm the step's last clip call returned over that true norm, 1.0 when
          clipping used the true norm. With one clip call it is that call's reported/true; with several
          (GA501) the last call's reported norm, not the first's: each call of a correct clip function
          reports the true norm of the gradient it sees, so the first call's ratio reads 1.0 however
          many times the step clipped, while the last call sees a gradient already clipped (or
          accumulated from clipped micro-batches) and its norm over the step's true norm shows by how
          much the gradient the optimizer stepped with was scaled wrongly.

        reported_norm: the norm the framework logs beside these as its grad_norm (its last clip call's
        on the logging rank), in place of the guard's. true_norm and the ratio are left out when not
        finite (a step with non-finite gradients still logs its anomaly)."""
        if self.skipped:
            return {}
        logged = {f"{prefix}anomaly": float(len(self.codes))}
        true_norm = self.true_norm
        if true_norm is None or not math.isfinite(true_norm):
            return logged
        logged[f"{prefix}true_norm"] = true_norm
        if reported_norm is None:
            reported_norm = self.last_reported_norm if self.clip_calls > 1 else None
            reported_norm = self.reported_norm if reported_norm is None else reported_norm
        if reported_norm is not None and math.isfinite(reported_norm) and true_norm > 0:
            logged[f"{prefix}reported_over_true"] = reported_norm / true_norm
        return logged

    def to_json(self) -> dict[str, Any]:
        return (
            {
                "step": self.step,
                "true_norm": _finite_or_text(self.true_norm),
                "reported_norm": _finite_or_text(self.reported_norm),
                "expected_coef": _finite_or_text(self.expected_coef),
                "min_coef": _finite_or_text(self.min_coef),
                "max_coef": _finite_or_text(self.max_coef),
                "coef_spread": _finite_or_text(self.coef_spread),
                "verdict": self.verdict,
                "codes": list(self.codes),
            }
            | ({"clip_calls": self.clip_calls} if self.clip_calls > 1 else {})
            | ({"spike": True} if self.spike else {})
        )

    def to_text(self) -> str:
        """The line as the trend file holds it: `json.dumps(self.to_json(), sort_keys=True)`, written
        out directly for a step with no codes, one clip call and no spike (every step of a sound run)."""
        if self.codes or self.clip_calls > 1 or self.spike or type(self.step) is not int:
            return json.dumps(self.to_json(), sort_keys=True)
        return (
            f'{{"codes": [], "coef_spread": {_number_text(self.coef_spread)}, '
            f'"expected_coef": {_number_text(self.expected_coef)}, "max_coef": {_number_text(self.max_coef)}, '
            f'"min_coef": {_number_text(self.min_coef)}, "reported_norm": {_number_text(self.reported_norm)}, '
            f'"step": {self.step}, "true_norm": {_number_text(self.true_norm)}, "verdict": "{self.verdict}"}}'
        )


def _number_text(value: float | None) -> str:
    """`value` as json.dumps writes `_finite_or_text(value)`."""
    if type(value) is float:
        return float.__repr__(value) if math.isfinite(value) else f'"{value}"'
    return json.dumps(_finite_or_text(value))


def _finite_or_text(value: float | None) -> float | str | None:
    """JSON has no nan or inf: they are written as the strings "nan", "inf", "-inf"."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def trend_line(report: Report, codes: tuple[str, ...]) -> TrendLine:
    """The trend line of a step from its report; its norms and expected coefficient are those the
    run's summary row shows (with several clip calls, GA501, the first call's), and the last call's
    reported norm, which the framework loggers divide by the true norm (see `TrendLine.metrics`)."""
    from ..report.model import first_call_numbers

    coefs = [r.applied_clip_coef for r in report.ranks if r.applied_clip_coef is not None]
    numbers = first_call_numbers(report)
    # the report's own rows are the last clip call's (first_call_numbers replaces them with the first's)
    last = next((row.reported_norm for row in report.ranks if row.reported_norm is not None), None)
    return TrendLine(
        step=report.step,
        true_norm=numbers.true_norm,
        reported_norm=numbers.reported_norm,
        expected_coef=numbers.expected_clip_coef,
        min_coef=min(coefs) if coefs else None,
        max_coef=max(coefs) if coefs else None,
        codes=codes,
        clip_calls=numbers.clip_calls,
        last_reported_norm=last if numbers.clip_calls > 1 else None,
    )


def skipped_line(step: int, reported_norm: float | None) -> TrendLine:
    """The trend line of a step every rank's GradScaler skipped: the norm its first clip call returned."""
    return TrendLine(
        step=step,
        true_norm=None,
        reported_norm=reported_norm,
        expected_coef=None,
        min_coef=None,
        max_coef=None,
        skipped=True,
    )


@dataclass(frozen=True, kw_only=True)
class Trend:
    """A trend file as read back: its newest lines, and what of it was not read."""

    path: str
    lines: tuple[TrendLine, ...]
    num_unread: int = 0
    """The older lines before the newest MAX_TREND_LINES, counted but not read: their failing steps
    are not known."""
    cut_short: int | None = None
    """The number of the last line when it is cut short (no newline, and not JSON: the guard was
    stopped while writing it, say by a full disk); it is read as the end of the file."""

    def __post_init__(self) -> None:
        if self.num_unread < 0:
            raise ValueError(f"num_unread must be 0 or more, got {self.num_unread}")
        if self.cut_short is not None and self.cut_short <= self.num_unread:
            raise ValueError(f"cut_short must number a line after the unread ones, got {self.cut_short}")

    @property
    def notes(self) -> tuple[str, ...]:
        """What of the file was not read, one sentence each."""
        name = Path(self.path).name
        notes = []
        if self.num_unread:
            were = "line was" if self.num_unread == 1 else "lines were"
            notes.append(
                f"{name}: its {self.num_unread} oldest {were} not read (only the newest "
                f"{MAX_TREND_LINES} are): a failing step among them is not counted"
            )
        if self.cut_short is not None:
            before = self.cut_short - 1 - self.num_unread
            notes.append(
                f"{name}: its last line ({self.cut_short}) is cut short (the guard was stopped while "
                f"writing it); read the {before} line{'' if before == 1 else 's'} before it"
            )
        return tuple(notes)


def read_trend(path: str | Path) -> Trend:
    """The newest MAX_TREND_LINES lines of a trend file, in file order. A last line cut short is the
    end of the file (as TensorBoard's reader takes a truncated final record); any other malformed
    line is a StepFolderError naming the file and line."""
    path = Path(path)
    limit = MAX_TREND_LINES  # read at call time: tests lower it
    try:
        with open(path, "rb") as handle:
            start, num_unread, size = _newest_lines_start(handle, path, limit)
            handle.seek(start)
            lines, cut_short = _parse_lines(handle, path, first_number=num_unread + 1, size=size)
    except OSError as exc:
        raise StepFolderError(f"{path}: cannot read the guard's trend file ({exc.strerror or exc})") from None
    return Trend(path=str(path), lines=lines, num_unread=num_unread, cut_short=cut_short)


def _newest_lines_start(handle: BinaryIO, path: Path, limit: int) -> tuple[int, int, int]:
    """The offset of the first of the newest `limit` lines, the number of lines before it, and the
    size counted: one pass counting newlines a chunk at a time (memory bounded by the chunk), one
    seek back."""
    chunks = []  # (offset, newlines before it) of each chunk
    offset = newlines = 0
    ends_with_newline = True
    while chunk := handle.read(_CHUNK_BYTES):
        chunks.append((offset, newlines))
        offset += len(chunk)
        newlines += chunk.count(b"\n")
        ends_with_newline = chunk.endswith(b"\n")
    num_lines = newlines + (not ends_with_newline)
    if num_lines <= limit:
        return 0, 0, offset
    unread = num_lines - limit  # the newest lines start after the unread-th newline
    chunk_offset, before = next((o, b) for o, b in reversed(chunks) if b < unread)
    handle.seek(chunk_offset)
    chunk = handle.read(_CHUNK_BYTES)
    position = -1
    for _ in range(unread - before):
        position = chunk.find(b"\n", position + 1)
        if position < 0:
            raise StepFolderError(f"{path}: the guard's trend file changed while it was read; check again")
    return chunk_offset + position + 1, unread, offset


def _parse_lines(
    handle: BinaryIO, path: Path, *, first_number: int, size: int
) -> tuple[tuple[TrendLine, ...], int | None]:
    """The trend lines from the handle's position to `size` (what a running guard appends after the
    count is left for the next check), and the number of a last line cut short."""
    lines: list[TrendLine] = []
    number = first_number - 1
    offset = handle.tell()
    while offset < size and (raw := handle.readline(MAX_LINE_BYTES + 1)):
        number += 1
        offset += len(raw)
        if len(raw) > MAX_LINE_BYTES:
            if _ends_the_file(handle):  # say, the zeros a crash leaves at the end of a file
                return tuple(lines), number
            raise _damaged(path, number, f"longer than {MAX_LINE_BYTES} bytes, not a trend line")
        if raw.isspace():
            continue
        try:
            text = raw.decode("utf-8").strip()
            doc, end = _DECODER.raw_decode(text)  # json.loads less its two whitespace scans: 1.3x faster
            if end != len(text):
                raise ValueError(f"extra data after the object at column {end + 1}")
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            if not raw.endswith(b"\n"):  # only the last line can lack its newline
                return tuple(lines), number
            raise _damaged(path, number, _not_json(exc)) from None
        try:
            lines.append(_trend_line_of(doc))
        except ValueError as exc:
            raise _damaged(path, number, str(exc)) from None
    return tuple(lines), None


def _not_json(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):  # its "line 1" would contradict the file's line number
        return f"not JSON ({exc.msg} at column {exc.colno})"
    return f"not JSON ({exc})"


def _ends_the_file(handle: BinaryIO) -> bool:
    """Read on to the end of the current line: True when the file ends before a newline."""
    while part := handle.readline(_CHUNK_BYTES):
        if part.endswith(b"\n"):
            return False
    return True


def _trend_line_of(doc: Any) -> TrendLine:
    if not isinstance(doc, dict):
        raise ValueError("not a JSON object")
    step = doc.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError("step must be an integer")
    codes = doc.get("codes", [])
    if not isinstance(codes, list) or (codes and not all(isinstance(c, str) for c in codes)):
        raise ValueError("codes must be a list of strings")
    calls = doc.get("clip_calls", 1)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError("clip_calls must be a positive integer")
    spike = doc.get("spike", False)  # absent from the lines of a guard without spike=, and older ones
    if not isinstance(spike, bool):
        raise ValueError(f"spike must be true or false, got {spike!r}")
    return TrendLine(
        step=step,
        true_norm=_number(doc, "true_norm"),
        reported_norm=_number(doc, "reported_norm"),
        expected_coef=_number(doc, "expected_coef"),
        min_coef=_number(doc, "min_coef"),
        max_coef=_number(doc, "max_coef"),
        codes=tuple(codes),
        skipped=doc.get("verdict") == "skipped",
        clip_calls=calls,
        spike=spike,
    )


def _number(doc: Mapping[str, Any], key: str) -> float | None:
    value = doc.get(key)
    if value is None or type(value) is float:
        return value
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def _damaged(path: Path, number: int, problem: str) -> StepFolderError:
    return StepFolderError(
        f"{path}:{number}: {problem}; the guard's trend file is damaged: remove the line or the file"
    )


def by_last_call(line: TrendLine) -> str:
    """With several clip calls, that the coefficients are the last one's (only its is measured)."""
    return "" if line.clip_calls == 1 else f" by the last of {line.clip_calls} clip calls"
