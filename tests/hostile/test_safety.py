"""Safe by construction: nothing from a dump executes or is interpreted, and faults are named."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import gradaudit.cli
from gradaudit.dumpfile import TensorReader, find_step_dirs, load_step
from gradaudit.errors import DumpFormatError

from .cli import assert_clean_refusal, run_cli
from .corpus import edit_header, rank_path, write_valid_step

PACKAGE = Path(gradaudit.cli.__file__).parent

FORBIDDEN = {
    "pickle": r"\bc?[pP]ickle\b",
    "torch.load": r"\btorch\.load\b",
    "eval(": r"(?<![\w.])eval\(",
    "exec(": r"(?<![\w.])exec\(",
    "marshal": r"\bmarshal\b",
    "shelve": r"\bshelve\b",
    "yaml.load": r"\byaml\.(unsafe_)?load\b",
    "numpy.load": r"\b(np|numpy)\.load\b",
    "__import__": r"__import__\(",
}


TEST_HELPERS = PACKAGE / "testing"
"""gradaudit.testing sends the user's own test functions to the rank processes it starts, by pickling
as multiprocessing does; it reads no dump but through the loader. Nothing else imports it."""
LAUNCHER = PACKAGE / "localranks.py"
"""The rank launcher gradaudit.testing and the demo share sends each rank its function and arguments
and gets back its result the same way, between processes it started itself; it reads no file."""


def _checked_sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if TEST_HELPERS not in p.parents and p != LAUNCHER)


def test_the_package_source_never_mentions_pickle_torch_load_eval_or_exec():
    sources = _checked_sources()
    assert len(sources) > 10
    hits = [
        f"{path.relative_to(PACKAGE)}:{number}: {what}"
        for path in sources
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for what, pattern in FORBIDDEN.items()
        if re.search(pattern, line)
    ]
    assert hits == []


def test_no_module_outside_the_test_helpers_imports_them():
    sources = sorted(path for path in PACKAGE.rglob("*.py") if TEST_HELPERS not in path.parents)
    hits = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sources
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bimport\b.*\btesting\b|\bfrom\s+(gradaudit)?\.*testing\b", line)
    ]
    assert hits == []


def test_the_forbidden_patterns_do_catch_what_they_are_meant_to_catch():
    samples = {
        "pickle": "import pickle",
        "torch.load": "x = torch.load(p)",
        "eval(": "eval(text)",
        "exec(": "exec(code)",
    }
    for what, sample in samples.items():
        assert re.search(FORBIDDEN[what], sample), what
    assert not re.search(FORBIDDEN["eval("], "self.retrieval(x)")


HOSTILE_NAMES = (
    "[red]alarm[/red]",
    "col|umn",
    "tick`code`",
    "line\nbreak",
    "esc\x1b[31mred\x1b[0m",
    "ünïcødé.权重",
    "%s{0}{__class__}",
)


def _write_hostile_step(root: Path) -> Path:
    """Every parameter has a nan gradient, so that `check` names each one in a finding (GA401)."""
    from gradaudit.capture.build import whole, write_rank
    from gradaudit.model import ClipRecord

    step_dir = root / "step_1"
    write_rank(
        step_dir,
        rank=0,
        world_size=1,
        step=1,
        params=dict.fromkeys(HOSTILE_NAMES, (2,)),
        pieces=[whole(name, grad=torch.tensor([1.0, float("nan")])) for name in HOSTILE_NAMES],
        clip=ClipRecord(max_norm=1.0, reported_norm=5.0),
        host="h",
        created_at="t",
    )
    return step_dir


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(k) + _strings(v)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def test_show_prints_hostile_parameter_names_escaped_in_the_terminal(tmp_path, capsys):
    step_dir = _write_hostile_step(tmp_path)
    outcome = run_cli(capsys, "show", str(step_dir))
    assert outcome.code == 0, outcome.stderr
    out = outcome.stdout
    assert "\x1b" not in out and "\r" not in out
    assert "[red]alarm[/red]" in out  # shown literally, not turned into colour
    assert "line\\nbreak" in out and "esc\\x1b[31mred\\x1b[0m" in out
    assert "col|umn" in out and "tick`code`" in out and "ünïcødé.权重" in out
    assert "%s{0}{__class__}" in out


def test_show_json_keeps_hostile_names_as_exact_data(tmp_path, capsys):
    step_dir = _write_hostile_step(tmp_path)
    outcome = run_cli(capsys, "show", str(step_dir), "--format", "json")
    assert outcome.code == 0, outcome.stderr
    assert "\x1b" not in outcome.stdout
    names = [p["name"] for p in json.loads(outcome.stdout)["params"]]
    assert sorted(names) == sorted(HOSTILE_NAMES)


def test_a_hostile_folder_name_in_an_error_stays_one_escaped_line(tmp_path, capsys):
    folder = tmp_path / "evil\n\x1b[31mname"
    folder.mkdir()
    outcome = run_cli(capsys, "show", str(folder))
    line = assert_clean_refusal(outcome, names="evil\\n\\x1b[31mname", problem="holds no rank files")
    assert "\x1b" not in line


# ------------------------------------------------------------------ internal errors


def _explode(*args, **kwargs):
    raise RuntimeError("boom from inside")


def test_an_internal_error_is_exit_3_with_one_line_and_a_debug_hint(tmp_path, capsys, monkeypatch):
    step_dir = write_valid_step(tmp_path / "step_7")
    monkeypatch.setattr("gradaudit.report.inventory.build_inventory", _explode)
    outcome = run_cli(capsys, "show", str(step_dir))
    assert outcome.code == 3
    assert len(outcome.stderr_lines) == 1 and "Traceback" not in outcome.stderr
    line = outcome.stderr_lines[0]
    assert line.startswith("internal error: RuntimeError: boom from inside")
    assert "bug in gradaudit, not in your dump" in line and "--debug" in line


def test_debug_prints_the_traceback_of_an_internal_error(tmp_path, capsys, monkeypatch):
    step_dir = write_valid_step(tmp_path / "step_7")
    monkeypatch.setattr("gradaudit.report.inventory.build_inventory", _explode)
    outcome = run_cli(capsys, "--debug", "show", str(step_dir))
    assert outcome.code == 3
    assert "Traceback (most recent call last)" in outcome.stderr
    assert "RuntimeError: boom from inside" in outcome.stderr
    assert outcome.stderr_lines[-1].startswith("internal error: RuntimeError")


def test_debug_also_shows_where_a_user_error_came_from(tmp_path, capsys):
    outcome = run_cli(capsys, "--debug", "show", str(tmp_path / "nowhere"))
    assert outcome.code == 2
    assert "StepFolderError" in outcome.stderr and outcome.stderr_lines[-1].startswith("error: ")


# ------------------------------------------------------------------ unreadable files


def _deny(monkeypatch, denied: Path) -> None:
    real_open = os.open

    def guarded_open(path, flags, *args, **kwargs):
        if os.fspath(path) == str(denied):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)


def test_an_unreadable_rank_file_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    step_dir = write_valid_step(tmp_path / "step_7")
    _deny(monkeypatch, rank_path(step_dir, 1))
    outcome = run_cli(capsys, "show", str(step_dir))
    assert_clean_refusal(
        outcome,
        names="rank_00001.safetensors",
        problem=r"cannot be read: permission denied \(check the file's permissions\)$",
    )


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root reads files whatever their mode; covered by the monkeypatched test"
)
def test_a_rank_file_without_read_permission_is_refused_naming_it(tmp_path, capsys):
    step_dir = write_valid_step(tmp_path / "step_7")
    rank_path(step_dir, 1).chmod(0)
    outcome = run_cli(capsys, "show", str(step_dir))
    assert_clean_refusal(outcome, names="rank_00001.safetensors", problem="permission denied")


def test_a_step_folder_that_cannot_be_listed_is_refused_naming_it(tmp_path, capsys, monkeypatch):
    step_dir = write_valid_step(tmp_path / "step_7")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)
    outcome = run_cli(capsys, "show", str(step_dir))
    assert_clean_refusal(
        outcome,
        names="step_7",
        problem=r"cannot be listed \(Permission denied\); check the folder's permissions$",
    )


# ------------------------------------------------------------------ faults between loading and reading


def test_a_file_truncated_after_loading_gives_a_format_error_not_a_crash(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    step = load_step(step_dir)
    path = step.ranks[1].path
    key = step.ranks[1].pieces[0].tensors["grad"]
    with TensorReader() as reader:
        assert reader.read(path, key).shape == (2, 3)
        os.truncate(path, os.path.getsize(path) - 70)  # 72 bytes of data: all tensors cut
        with pytest.raises(
            DumpFormatError, match=r"rank_00001\.safetensors: tensor '.*' is cut short at byte \d+"
        ):
            reader.read(path, step.ranks[1].pieces[1].tensors["grad_clipped"])


def test_a_file_truncated_before_its_first_tensor_read_is_refused_naming_it(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    step = load_step(step_dir)
    path = step.ranks[0].path
    os.truncate(path, os.path.getsize(path) - 4)
    with (
        TensorReader(step) as reader,
        pytest.raises(DumpFormatError, match=r"rank_00000\.safetensors: .*truncated"),
    ):
        reader.read(path, step.ranks[0].pieces[0].tensors["grad"])


def test_a_file_replaced_by_another_dump_after_loading_is_refused_when_the_step_is_known(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    step = load_step(step_dir)
    other = write_valid_step(tmp_path / "other", names=("v", "c"))
    shutil.copyfile(rank_path(other, 0), rank_path(step_dir, 0))
    with (
        TensorReader(step) as reader,
        pytest.raises(DumpFormatError, match="changed on disk after it was loaded"),
    ):
        reader.read(step.ranks[0].path, step.ranks[0].pieces[0].tensors["grad"])


def test_a_read_of_a_tensor_claiming_1e15_rows_of_nothing_ends_at_once(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    path = rank_path(step_dir, 0)
    edit_header(
        path, lambda h: h.__setitem__("ghost", {"dtype": "F32", "shape": [10**15, 0], "data_offsets": [0, 0]})
    )
    with TensorReader() as reader:
        assert reader.read(str(path), "ghost").shape == (10**15, 0)


def test_whole_reads_give_every_float_dtype_bit_for_bit(tmp_path):
    from gradaudit.capture.build import whole, write_rank
    from gradaudit.model import ClipRecord

    dtypes = (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
    values = torch.linspace(-3, 3, 35).reshape(5, 7)
    write_rank(
        tmp_path,
        rank=0,
        world_size=1,
        step=1,
        params={str(d): (5, 7) for d in dtypes},
        pieces=[whole(str(d), grad=values.to(d)) for d in dtypes],
        clip=ClipRecord(max_norm=1.0),
    )
    step = load_step(tmp_path)
    with TensorReader(step) as reader:
        for piece, dtype in zip(step.ranks[0].pieces, dtypes, strict=False):
            whole_tensor = reader.read(step.ranks[0].path, piece.tensors["grad"])
            assert whole_tensor.dtype == dtype
            assert torch.equal(whole_tensor.view(torch.uint8), values.to(dtype).view(torch.uint8))


def test_a_step_link_loop_in_a_run_folder_is_listed_so_that_loading_explains_it(tmp_path):
    write_valid_step(tmp_path / "step_7")
    (tmp_path / "step_9").symlink_to("step_9")
    steps = find_step_dirs(tmp_path)
    assert [p.name for p in steps] == ["step_7", "step_9"]
    with pytest.raises(Exception, match="step_9: is a symbolic link loop"):
        load_step(steps[1])


def test_a_rank_file_named_for_another_rank_is_loaded_with_a_warning(tmp_path):
    step_dir = write_valid_step(tmp_path / "step_7")
    rank_path(step_dir, 1).rename(step_dir / "rank_00003.safetensors")
    step = load_step(step_dir)
    assert step.ranks_present == (0, 1)
    assert any("rank_00003.safetensors: named for rank 3 but holds rank 1" in w for w in step.warnings)


def _change_after_loading(monkeypatch, change) -> None:
    """Run `change` right after the loader has validated every file, before any tensor is read."""
    from gradaudit.dumpfile import loader

    real_assemble = loader.assemble_step

    def assemble_then_change(*args, **kwargs):
        step = real_assemble(*args, **kwargs)
        change()
        return step

    monkeypatch.setattr(loader, "assemble_step", assemble_then_change)


def test_check_refuses_a_file_truncated_between_loading_and_reading_naming_it(tmp_path, capsys, monkeypatch):
    step_dir = write_valid_step(tmp_path / "step_7")
    victim = rank_path(step_dir, 1)
    _change_after_loading(monkeypatch, lambda: os.truncate(victim, victim.stat().st_size - 70))
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_clean_refusal(
        outcome,
        names=victim.name,
        problem=r"ends at byte \d+ of a 2-byte data section \(the file is truncated\)$",
    )


def test_check_refuses_a_file_replaced_between_loading_and_reading_naming_it(tmp_path, capsys, monkeypatch):
    step_dir = write_valid_step(tmp_path / "step_7")
    other = write_valid_step(tmp_path / "other", names=("v", "c"))
    victim = rank_path(step_dir, 1)
    _change_after_loading(monkeypatch, lambda: shutil.copyfile(rank_path(other, 1), victim))
    outcome = run_cli(capsys, "check", str(step_dir))
    assert_clean_refusal(
        outcome, names=victim.name, problem=r"changed on disk after it was loaded \(let the dump finish"
    )


@pytest.mark.parametrize("format", ["terminal", "markdown", "json"])
def test_check_names_hostile_parameters_without_raw_control_bytes_or_live_markup(tmp_path, capsys, format):
    step_dir = _write_hostile_step(tmp_path)
    outcome = run_cli(capsys, "check", str(step_dir), "--format", format)
    assert outcome.code == 1 and "GA401" in outcome.stdout, outcome.stderr
    out = outcome.stdout
    assert "\x1b" not in out and "\r" not in out and "line\nbreak" not in out
    if format == "json":
        strings = " ".join(_strings(json.loads(out)))
        assert all(name in strings for name in HOSTILE_NAMES)
    else:
        flat = " ".join(out.split())
        assert all(word in flat for word in ("alarm", "umn", "code", "break", "ünïcødé.权重", "esc"))
    if format == "terminal":
        assert "[red]alarm[/red]" in flat and "esc\\x1b[31mred" in flat


def test_check_of_a_run_folder_names_a_broken_step_instead_of_skipping_it(tmp_path, capsys):
    write_valid_step(tmp_path / "step_7")
    (tmp_path / "step_9").symlink_to("step_9")
    outcome = run_cli(capsys, "check", str(tmp_path))
    assert_clean_refusal(outcome, names="step_9", problem="is a symbolic link loop")
