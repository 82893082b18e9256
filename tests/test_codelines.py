"""bench/codelines.py counts code lines exactly and places every module of the package in one stage."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import codelines  # noqa: E402

SOURCE = '''"""A module docstring
over two lines."""

# a comment
import os  # a comment after code

TEMPLATE = """a multi-line string
that is assigned,
so it is code"""


class Record:
    """A class docstring."""

    name: str
    """An attribute docstring."""

    def size(self) -> int:
        # a comment inside
        return len(
            self.name
        )


print("a call" , 'with strings')
'''
"""Code lines: 5 (import), 7-9 (the assigned string), 12 (class), 15 (name), 18 (def), 20-22
(return), 25 (print): 11 lines."""


def test_code_lines_count_code_and_assigned_strings_but_not_docstrings_comments_or_blanks() -> None:
    assert codelines.code_lines(SOURCE) == 11


def test_a_docstring_on_the_line_of_its_def_leaves_the_def_counted() -> None:
    assert (
        codelines.code_lines('def f(): "doc"\nx = ("one"\n     "two")\n("only a string"\n "statement")\n')
        == 3
    )


def test_a_non_ascii_line_before_a_docstring_does_not_shift_it() -> None:
    assert codelines.code_lines('x = "é"; "a docstring after code"\n"é"\n') == 1


def test_every_module_of_the_package_is_in_exactly_one_stage() -> None:
    root = REPO / "gradaudit"
    modules = sorted(root.rglob("*.py"))
    assert modules
    unassigned = [
        str(m.relative_to(root)) for m in modules if codelines.stage_of(m, root) == codelines.UNASSIGNED
    ]
    assert unassigned == [], f"add each to a stage in bench/codelines.py: {unassigned}"
    members = [member for stage in codelines.STAGES for member in stage.members]
    assert len(members) == len(set(members)), "a name is listed in two stages"


def test_the_table_names_an_unassigned_module_and_counts_it_in_the_package(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text("x = 1\n")
    (tmp_path / "stray.py").write_text("y = 2\nz = 3\n")
    lines = list(codelines.table(codelines.count_by_stage(tmp_path)))
    assert any(line.startswith("vocabulary") and line.split()[1] == "1" for line in lines), lines
    assert any(line.startswith("unassigned: stray.py") and line.split()[2] == "2" for line in lines), lines
    package = next(line for line in lines if line.startswith("package"))
    assert package.split()[1:3] == ["3", str(codelines.PACKAGE_BUDGET)]
