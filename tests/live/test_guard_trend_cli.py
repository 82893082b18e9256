"""`gradaudit check RUN_DIR` on the guard's trend file as a long or stopped run leaves it: a last line
cut short ends the file, a longer file is read from its newest lines, and failing steps fail the check."""

from __future__ import annotations

import json

import pytest
from builders import clean_step

from gradaudit.live import trend
from gradaudit.live.trend import TREND_FILE, TrendLine, read_trend


def _line(step: int, codes: tuple[str, ...] = ()) -> bytes:
    line = TrendLine(
        step=step,
        true_norm=1.5,
        reported_norm=1.5 if not codes else 0.5,
        expected_coef=0.6,
        min_coef=0.6,
        max_coef=0.6,
        codes=codes,
    )
    return (json.dumps(line.to_json(), sort_keys=True) + "\n").encode()  # as the guard writes it


def _run_folder(tmp_path, steps, *, failing=(), tail=b""):
    """A guarded run's folder whose trend holds `steps`, those in `failing` with GA201, then `tail`."""
    folder = tmp_path / "run"
    folder.mkdir()
    lines = b"".join(_line(step, ("GA201",) if step in failing else ()) for step in steps)
    (folder / TREND_FILE).write_bytes(lines + tail)
    return folder


def test_a_clean_trend_alone_exits_0(tmp_path, cli):
    code, out, err = cli("check", _run_folder(tmp_path, range(1, 4)))
    assert (code, err) == (0, "")
    assert out.startswith("guard trend: 3 checked steps, 0 with wrong clipping\n")
    assert "warning" not in out


def test_failing_steps_in_the_trend_exit_1_without_dump_folders_unless_fail_on_is_never(tmp_path, cli):
    folder = _run_folder(tmp_path, range(1, 4), failing={2})
    code, out, _ = cli("check", folder)
    assert code == 1 and "  step 2: GA201" in out
    assert cli("check", folder, "--format", "json")[0] == 1
    assert cli("check", folder, "--fail-on", "warning")[0] == 1
    assert cli("check", folder, "--fail-on", "never")[0] == 0


def test_failing_steps_in_the_trend_exit_1_even_when_every_dump_folder_is_clean(tmp_path, cli):
    folder = _run_folder(tmp_path, range(1, 4), failing={2})
    clean_step(folder / "step_1")
    code, out, _ = cli("check", folder)
    assert code == 1
    assert out.startswith("guard trend: 3 checked steps, 1 with wrong clipping\n  step 2: GA201")
    assert "No errors, warnings or missing ranks in step 1." in out  # the dump was audited: clean
    assert cli("check", folder, "--format", "json")[0] == 1
    assert cli("check", folder, "--fail-on", "never")[0] == 0
    (tmp_path / "run" / TREND_FILE).write_bytes(b"".join(_line(step) for step in range(1, 4)))
    assert cli("check", folder)[0] == 0


@pytest.mark.parametrize(
    "tail",
    [_line(5)[:70], _line(5, ("GA201",))[:-2], b"\0" * 4096, b"\0" * (trend.MAX_LINE_BYTES + 10)],
    ids=["cut mid-line", "cut before its closing brace", "zeros a crash left", "zeros past the line bound"],
)
def test_a_last_line_cut_short_ends_the_trend_with_a_warning_and_the_lines_before_it_are_audited(
    tmp_path, cli, tail
):
    folder = _run_folder(tmp_path, range(1, 5), failing={3}, tail=tail)
    warning = (
        "warning: guard_trend.jsonl: its last line (5) is cut short (the guard was stopped while writing "
        "it); read the 4 lines before it"
    )
    code, out, err = cli("check", folder)
    assert code == 1 and err == ""
    assert out.splitlines()[:3] == [
        "guard trend: 4 checked steps, 1 with wrong clipping",
        "  " + warning,
        "  step 3: GA201 (true norm 1.5, reported 0.5, coefficients 0.6..0.6) · not dumped",
    ]
    code, out, err = cli("check", folder, "--format", "json")
    assert (code, err) == (1, warning + "\n")  # on stderr beside the report, and in it
    assert json.loads(out)["guard_trend"]["notes"] == [warning.removeprefix("warning: ")]


@pytest.mark.parametrize(
    "lines, number",
    [
        ([_line(1), b'{"step": 2, "true_norm\n', _line(3)], 2),
        ([_line(1), _line(2), b"{not json\n"], 3),  # a whole last line is damage, not a cut
        ([_line(1), b'{"step": "two"}\n', _line(3)], 2),
        ([_line(1), b"\xff\xfe\n", _line(3)], 2),
        ([_line(1), b"x" * (trend.MAX_LINE_BYTES + 1) + b"\n", _line(3)], 2),
    ],
    ids=["cut in the middle", "complete last line", "not a trend line", "not UTF-8", "too long"],
)
def test_a_malformed_line_other_than_a_cut_last_one_exits_2_with_one_line_naming_the_file_and_line(
    tmp_path, cli, lines, number
):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / TREND_FILE).write_bytes(b"".join(lines))
    code, out, err = cli("check", folder)
    assert (code, out) == (2, "") and "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith(f"error: {folder / TREND_FILE}:{number}: ")
    assert line.endswith("the guard's trend file is damaged: remove the line or the file")


def test_a_trend_over_the_bound_is_read_from_its_newest_lines_and_names_a_failing_step_among_them(
    tmp_path, cli, monkeypatch
):
    monkeypatch.setattr(trend, "MAX_TREND_LINES", 1000)
    monkeypatch.setattr(trend, "_CHUNK_BYTES", 4096)  # the newest lines start in a later chunk
    folder = _run_folder(tmp_path, range(1, 1201), failing={1047})
    code, out, _ = cli("check", folder)
    assert code == 1
    assert out.splitlines()[:3] == [
        "guard trend: the newest 1000 checked steps, 1 with wrong clipping",
        "  warning: guard_trend.jsonl: its 200 oldest lines were not read (only the newest 1000 are): "
        "a failing step among them is not counted",
        "  step 1047: GA201 (true norm 1.5, reported 0.5, coefficients 0.6..0.6) · not dumped",
    ]
    assert out.splitlines()[-1].split()[0] == "1200"  # the last step shown is the last written


def test_a_failing_step_among_the_older_lines_over_the_bound_is_not_read_and_the_warning_says_so(
    tmp_path, cli, monkeypatch
):
    monkeypatch.setattr(trend, "MAX_TREND_LINES", 1000)
    code, out, err = cli("check", _run_folder(tmp_path, range(1, 1201), failing={150}), "--format", "json")
    warning = (
        "guard_trend.jsonl: its 200 oldest lines were not read (only the newest 1000 are): "
        "a failing step among them is not counted"
    )
    assert code == 0 and err == f"warning: {warning}\n"
    reported = json.loads(out)["guard_trend"]
    assert (reported["num_unread"], reported["notes"], reported["failing"]) == (200, [warning], [])


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1 << 20])
def test_the_newest_lines_are_the_file_s_last_ones_at_any_bound_and_chunk_size(
    tmp_path, monkeypatch, chunk_bytes
):
    monkeypatch.setattr(trend, "_CHUNK_BYTES", chunk_bytes)
    for cut in (b"", _line(31)[:9]):
        path = tmp_path / f"{len(cut)}.jsonl"
        path.write_bytes(b"".join(b"\n" if step % 7 == 0 else _line(step) for step in range(1, 31)) + cut)
        num_lines = 30 + (cut != b"")
        for limit in range(1, num_lines + 3):
            monkeypatch.setattr(trend, "MAX_TREND_LINES", limit)
            read = read_trend(path)
            first = max(1, num_lines - limit + 1)
            assert [line.step for line in read.lines] == [s for s in range(first, 31) if s % 7], limit
            assert read.num_unread == first - 1
            assert read.cut_short == (31 if cut else None)
