"""`gradaudit check` and `gradaudit explain` from the command line: output, files and exit codes."""

import json

import torch
from builders import clean_step, clip, sharded_rows, tensor_with_norm

from gradaudit.checks.registry import CHECKS
from gradaudit.model import DataRecord


def _local(directory, step=1):
    grads = [tensor_with_norm(0.8, (2, 3), seed=r, dtype=torch.float64) for r in range(4)]
    return sharded_rows(directory, grads, clips=clip(1.0, reported_norm=0.8, clip_coef=1.0), step=step)


def test_a_clean_step_exits_0_and_a_buggy_one_exits_1(tmp_path, cli):
    code, out, _ = cli("check", str(clean_step(tmp_path / "clean")))
    assert code == 0 and "Clipping used the true global norm" in " ".join(out.split())
    code, out, _ = cli("check", str(_local(tmp_path / "local")))
    assert code == 1 and "GA201" in out


def test_fail_on_sets_the_severity_that_fails(tmp_path, cli):
    warned = clean_step(
        tmp_path / "warn",
        data={
            0: DataRecord(tokens=10, loss_reduction="mean"),
            1: DataRecord(tokens=20, loss_reduction="mean"),
        },
    )
    assert cli("check", str(warned))[0] == 0
    assert cli("check", str(warned), "--fail-on", "warning")[0] == 1
    assert cli("check", str(_local(tmp_path / "local")), "--fail-on", "never")[0] == 0


def test_json_output_is_valid_and_the_same_bytes_twice(tmp_path, cli):
    step = _local(tmp_path / "local")
    first = cli("check", str(step), "--format", "json")[1]
    second = cli("check", str(step), "--format", "json")[1]
    assert first == second
    doc = json.loads(first)
    assert {f["code"] for f in doc["findings"]} >= {"GA201", "GA302"}
    assert abs(doc["global_norm"] - 1.6) < 1e-9


def test_output_writes_the_report_file_and_refuses_folders_and_dump_folders(tmp_path, cli):
    step = _local(tmp_path / "local")
    before = sorted(p.name for p in step.iterdir())
    target = tmp_path / "report.md"
    code, out, err = cli("check", str(step), "--format", "markdown", "--output", str(target))
    assert code == 1 and out == "" and "GA201" in target.read_text()
    code, _, err = cli("check", str(step), "--output", str(tmp_path))
    assert code == 2 and "folder" in err
    code, _, err = cli("check", str(step), "--output", str(step / "report.md"))
    assert code == 2 and "inside the dump folder" in err
    assert sorted(p.name for p in step.iterdir()) == before


def test_unusable_input_and_bad_options_exit_2(tmp_path, cli):
    code, _, err = cli("check", str(tmp_path / "nothing"))
    assert code == 2 and "nothing" in err
    code, _, err = cli("check", str(clean_step(tmp_path / "clean")), "--rtol", "-1")
    assert code == 2 and "rtol" in err
    assert cli("check", str(tmp_path), "--format", "yaml")[0] == 2


def test_a_folder_of_steps_is_checked_step_by_step(tmp_path, cli):
    clean_step(tmp_path / "run" / "step_1")
    _local(tmp_path / "run" / "step_2", step=2)
    code, out, _ = cli("check", str(tmp_path / "run"), "--format", "json")
    doc = json.loads(out)
    assert code == 1
    assert [s["step"] for s in doc["summary"]] == [1, 2]
    assert "GA201" in doc["summary"][1]["codes"] and "GA201" not in doc["summary"][0]["codes"]
    assert abs(doc["summary"][1]["global_norm"] - 1.6) < 1e-9 and doc["summary"][1]["reported_norm"] == 0.8


def test_explain_prints_the_sections_and_all_lists_every_code(cli):
    code, out, _ = cli("explain", "GA201")
    assert code == 0
    for heading in ("What it checks", "Why it matters", "Example", "How to fix it"):
        assert heading in out
    code, out, _ = cli("explain", "--all")

    assert code == 0 and len([line for line in out.splitlines() if line.startswith("GA")]) == len(CHECKS)
    assert cli("explain", "GA999")[0] == 2


def test_all_ranks_lists_every_rank_where_the_default_folds_ranks_that_agree(tmp_path, cli):
    step = _local(tmp_path / "local")
    for fmt, folded_row, single_row in (
        ("markdown", "\n| 0-3 | 0.8 |", "\n| 2 | 0.8 |"),
        ("terminal", "\n  0-3 ", "\n   2 "),
    ):
        _, folded, _ = cli("check", str(step), "--format", fmt)
        _, every, _ = cli("check", str(step), "--format", fmt, "--all-ranks")
        assert folded_row in folded and single_row not in folded
        assert single_row in every and folded_row not in every
    _, data, _ = cli("check", str(step), "--format", "json")
    assert [row["rank"] for row in json.loads(data)["ranks"]] == [0, 1, 2, 3]
