"""Files that are not standard safetensors, the open-file limit, and
honest numbers at the edges of float64."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from builders import FIXED, check

from gradaudit.capture.build import flat, whole, write_rank
from gradaudit.dumpfile.dump import RankDump, as_columns
from gradaudit.dumpfile.writer import write_rank_file
from gradaudit.model import ClipRecord, FlatRange, ParamInfo, Piece, TensorStats

from .cli import assert_clean_refusal, assert_report_or_clean_refusal, run_cli
from .corpus import (
    header_bytes,
    rank_path,
    read_parts,
    write_header_bytes,
    write_parts,
    write_valid_step,
)

ROOT = Path(__file__).resolve().parents[2]


def _entries(parts) -> list[tuple[str, dict]]:
    return sorted(
        ((k, v) for k, v in parts.header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
    )


def test_overlapping_data_offsets_are_refused_as_not_standard_safetensors(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    path = rank_path(step_dir, 0)
    parts = read_parts(path)
    (_, a), (_, b) = _entries(parts)[:2]
    size = a["data_offsets"][1] - a["data_offsets"][0]
    assert size == b["data_offsets"][1] - b["data_offsets"][0]
    b["data_offsets"] = list(a["data_offsets"])  # the clipped gradient points at the gradient's bytes
    parts.data = parts.data[:size] + parts.data[2 * size :]
    for _, entry in _entries(parts)[2:]:
        entry["data_offsets"] = [o - size for o in entry["data_offsets"]]
    write_parts(path, parts)
    for command in ("check", "show"):
        outcome = run_cli(capsys, command, str(step_dir))
        assert_clean_refusal(outcome, names=path.name, problem="overlaps the bytes of another tensor")


def test_junk_bytes_before_the_first_tensor_are_refused(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    path = rank_path(step_dir, 1)
    parts = read_parts(path)
    for _, entry in _entries(parts):
        entry["data_offsets"] = [o + 16 for o in entry["data_offsets"]]
    parts.data = b"\x00" * 16 + parts.data
    write_parts(path, parts)
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_clean_refusal(outcome, names=path.name, problem="16 bytes before tensor .* belong to no tensor")


def test_bytes_after_the_last_tensor_are_refused(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    path = rank_path(step_dir, 0)
    header, data = header_bytes(path)
    write_header_bytes(path, header, data + b"junk")
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_clean_refusal(outcome, names=path.name, problem="the last 4 bytes of the file belong to no tensor")


def test_files_written_by_the_safetensors_library_still_pass_the_layout_check(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    outcome = run_cli(capsys, "check", str(step_dir))
    assert outcome.code == 0, outcome.stderr


def _run_python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _many_ranks(step_dir: Path, world_size: int) -> None:
    for rank in range(world_size):
        write_rank(
            step_dir,
            rank=rank,
            world_size=world_size,
            step=1,
            params={"w": (world_size * 4,)},
            pieces=[flat("w", 4 * rank, grad=torch.full((4,), 0.5))],
            clip=ClipRecord(max_norm=1e9, reported_norm=math.sqrt(world_size), clip_coef=1.0),
            **FIXED,
        )


def test_more_rank_files_than_the_open_file_limit_are_all_read(tmp_path):
    step_dir = tmp_path / "step_1"
    _many_ranks(step_dir, 150)
    result = _run_python(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from gradaudit.cli import main
        main(["check", {str(step_dir)!r}, "--format", "json"])
        """
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    assert '"global_norm": 12.247448713915' in result.stdout


def test_running_out_of_file_descriptors_is_reported_as_the_limit_not_as_a_broken_file(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    result = _run_python(
        f"""
        import contextlib, io, os, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from gradaudit.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["check", {str(step_dir)!r}])  # every module imported while files can still be opened
        held = []
        try:
            while True:
                held.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        main(["check", {str(step_dir)!r}])
        """
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "reached its limit of 48 open files" in lines[0] and "ulimit -n" in lines[0], lines[0]


def _float64_step(tmp_path: Path, values: dict[str, torch.Tensor], **clip_fields) -> Path:
    write_rank(
        tmp_path,
        rank=0,
        world_size=1,
        step=1,
        params={name: tuple(v.shape) for name, v in values.items()},
        pieces=[whole(name, grad=v) for name, v in values.items()],
        clip=ClipRecord(max_norm=1.0, **clip_fields),
        **FIXED,
    )
    return tmp_path


def test_a_p_norm_term_beyond_float64_is_named_with_its_power(tmp_path):
    """The sum of squares fits, the sum of cubes does not: the note names the cubes."""
    step_dir = _float64_step(
        tmp_path, {"a": torch.tensor([1e110, 2.0], dtype=torch.float64)}, norm_type=3.0, reported_norm=1.0
    )
    report = check(step_dir)
    assert report.global_norm == math.inf
    notes = [w for w in report.warnings if "exceeds float64" in w]
    assert len(notes) == 1 and notes[0].startswith("a on rank 0: the sum of |x|^3 of its finite"), notes


def test_two_gradients_whose_squares_sum_beyond_float64_give_their_finite_norm(tmp_path, capsys):
    step_dir = _float64_step(
        tmp_path,
        {
            "a": torch.tensor([1.2e154], dtype=torch.float64),
            "b": torch.tensor([1.2e154], dtype=torch.float64),
        },
        reported_norm=1.2e154 * math.sqrt(2),
        clip_coef=1.0 / (1.2e154 * math.sqrt(2)),
    )
    report = check(step_dir)
    assert report.global_norm == pytest.approx(1.2e154 * math.sqrt(2), rel=1e-12)
    assert_report_or_clean_refusal(run_cli(capsys, "check", str(step_dir)))


def _stats_step(tmp_path: Path, stats: dict[str, TensorStats], norm_type: float = 2.0, **clip_fields) -> Path:
    """A one-rank stats-only step whose pieces carry exactly `stats` (numbers no real tensor has)."""
    pieces = tuple(
        Piece(
            index=i,
            param=name,
            regions=(FlatRange(start=0, stop=s.numel),),
            local_shape=(s.numel,),
            dtype="float64",
            stats={"grad": s},
        )
        for i, (name, s) in enumerate(stats.items())
    )
    params = tuple(
        ParamInfo(name=name, global_shape=(s.numel,), dtype="float64") for name, s in stats.items()
    )
    dump = RankDump(
        path="",
        rank=0,
        world_size=1,
        step=1,
        mode="stats",
        params=params,
        pieces=as_columns(params, pieces),
        clip=ClipRecord(max_norm=1.0, norm_type=norm_type, **clip_fields),
        **FIXED,
    )
    write_rank_file(tmp_path, dump, {})
    return tmp_path


def _stats(
    sum_sq: float, norm_type: float = 2.0, sum_pow: float | None = None, max_abs: float = 1.0
) -> TensorStats:
    return TensorStats(
        numel=4,
        norm_type=norm_type,
        sum_pow=sum_sq if sum_pow is None else sum_pow,
        sum_sq=sum_sq,
        max_abs=max_abs,
    )


def test_stats_whose_sum_overflows_float64_are_audited_without_an_internal_error(tmp_path, capsys):
    step_dir = _stats_step(
        tmp_path,
        {"a": _stats(1.5e308, max_abs=1e154), "b": _stats(1.5e308, max_abs=1e154)},
        reported_norm=1.0,
    )
    report = check(step_dir)
    assert report.global_norm == pytest.approx(math.sqrt(1.5e308) * math.sqrt(2), rel=1e-12)
    assert_report_or_clean_refusal(run_cli(capsys, "check", str(step_dir)))


@pytest.mark.parametrize("norm_type", [0.001, 1e4])
def test_extreme_norm_types_are_audited_without_an_internal_error(tmp_path, capsys, norm_type):
    step_dir = _stats_step(
        tmp_path / "stats",
        {"a": _stats(2.0, norm_type=norm_type, sum_pow=4.0)},
        norm_type=norm_type,
        reported_norm=1.0,
        loss_scale=65536.0,
        unscaled_before_clip=False,
    )
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_report_or_clean_refusal(outcome)
    assert outcome.code in (0, 1)


@pytest.mark.parametrize("loss_scale", [1e200, 1e-200, 1e308])
def test_extreme_loss_scales_are_audited_without_an_internal_error(tmp_path, capsys, loss_scale):
    step_dir = _stats_step(
        tmp_path, {"a": _stats(2.0)}, reported_norm=1.0, loss_scale=loss_scale, unscaled_before_clip=False
    )
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_report_or_clean_refusal(outcome)
    assert outcome.code in (0, 1)


def test_a_sum_of_squares_beyond_float64_is_reported_as_an_infinite_norm_with_its_reason(tmp_path, capsys):
    step_dir = _float64_step(
        tmp_path, {"a": torch.tensor([1e200, -1e200, 3.0], dtype=torch.float64)}, reported_norm=1.0
    )
    report = check(step_dir)
    assert report.global_norm == math.inf
    assert any("a on rank 0" in w and "exceeds float64" in w for w in report.warnings), report.warnings
    assert_report_or_clean_refusal(run_cli(capsys, "check", str(step_dir)))
