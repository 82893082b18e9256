"""`check --output` never writes over a file of the dump it reads, by any name, and
writes its report through a temporary renamed into place."""

from __future__ import annotations

import os

import pytest

from .cli import assert_clean_refusal, run_cli
from .corpus import rank_path, write_valid_step


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("given", ["step", "run"], ids=["step-folder", "run-folder"])
def test_output_at_a_hard_link_of_a_rank_file_is_refused_and_the_dump_is_untouched(tmp_path, capsys, given):
    step_dir = write_valid_step(tmp_path / "run" / "step_7")
    before = _files(tmp_path / "run")
    link = tmp_path / "r.md"
    os.link(rank_path(step_dir, 0), link)
    folder = step_dir if given == "step" else step_dir.parent
    outcome = run_cli(capsys, "check", str(folder), "--output", str(link))
    assert_clean_refusal(
        outcome, names="r.md", problem=r"another name \(a hard link\) of .*rank_00000\.safetensors"
    )
    assert _files(tmp_path / "run") == before


def test_output_at_a_hard_link_of_a_reference_file_is_refused(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "run" / "step_7")
    reference = write_valid_step(tmp_path / "ref" / "step_7")
    link = tmp_path / "r.md"
    os.link(rank_path(reference, 1), link)
    before = rank_path(reference, 1).read_bytes()
    outcome = run_cli(capsys, "check", str(step_dir), "--reference", str(reference), "--output", str(link))
    assert_clean_refusal(outcome, names="r.md", problem="a hard link")
    assert rank_path(reference, 1).read_bytes() == before


def test_a_report_replaces_the_output_name_and_leaves_its_other_names_alone(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    kept = tmp_path / "notes.txt"
    kept.write_text("my notes\n")
    report = tmp_path / "report.md"
    os.link(kept, report)
    os.chmod(report, 0o640)
    outcome = run_cli(capsys, "check", str(step_dir), "--format", "markdown", "--output", str(report))
    assert outcome.code == 0, outcome.stderr
    assert kept.read_text() == "my notes\n"
    assert "gradaudit" in report.read_text() and report.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "report.md", "step_7"]


def test_a_report_goes_through_a_symlink_and_to_a_device(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    real = tmp_path / "real.md"
    real.write_text("old")
    (tmp_path / "via.md").symlink_to(real)
    assert run_cli(capsys, "check", str(step_dir), "--output", str(tmp_path / "via.md")).code == 0
    assert (tmp_path / "via.md").is_symlink() and "old" not in real.read_text()
    assert run_cli(capsys, "check", str(step_dir), "--output", os.devnull).code == 0
