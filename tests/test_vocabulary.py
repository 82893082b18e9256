"""The shared vocabulary stays documented and typed: field docstrings on the dataclasses that cross
module boundaries, and one keyword-only signature for the public capture API."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import gradaudit
from gradaudit.model import MODES, TENSOR_KINDS

PACKAGE = Path(gradaudit.__file__).parent
NOT_WALKED = (
    "analysis/",
    "live/",
    *(f"capture/{name}.py" for name in ("build", "write", "snapshots", "tensorstats")),
)
"""Folders and files whose dataclasses are documented by their own work in progress."""
DOCUMENTED = sorted(
    p for p in PACKAGE.rglob("*.py") if not p.relative_to(PACKAGE).as_posix().startswith(NOT_WALKED)
)
"""Every field of a public dataclass here says what its name and type do not."""


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Name | ast.Attribute) and ast.unparse(target).endswith("dataclass"):
            return True
    return False


def undocumented_fields(source: str) -> list[str]:
    """`Class.field` for each field of a public dataclass not followed by a string expression statement."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.ClassDef) and _is_dataclass(node)) or node.name.startswith("_"):
            continue
        for statement, after in zip(node.body, [*node.body[1:], None], strict=True):
            if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
                continue
            if "ClassVar" in ast.unparse(statement.annotation):
                continue
            documented = (
                isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            )
            if not documented:
                found.append(f"{node.name}.{statement.target.id}")
    return found


@pytest.mark.parametrize("path", DOCUMENTED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_field_of_a_shared_dataclass_has_a_docstring(path):
    missing = undocumented_fields(path.read_text())
    assert not missing, (
        f"{path.relative_to(PACKAGE)}: document these fields with a line under each: {missing}"
    )


def test_the_docstring_walker_finds_a_field_without_one():
    source = (
        "@dataclass(frozen=True, kw_only=True)\n"
        "class A:\n"
        "    named: int\n"
        '    """Said."""\n'
        "    silent: str = ''\n"
        "    last: float = 0.0\n"
        "@dataclass\n"
        "class _Private:\n"
        "    unsaid: int\n"
    )
    assert undocumented_fields(source) == ["A.silent", "A.last"]


def test_tensor_kinds_and_modes_are_the_file_formats_strings():
    assert TENSOR_KINDS == ("grad", "grad_clipped", "param_before", "param_after")
    assert MODES == ("full", "stats")


def _options(fn):
    return {
        name: (p.kind, p.default, p.annotation)
        for name, p in inspect.signature(fn).parameters.items()
        if name not in ("model", "out_dir")
    }


def test_the_capture_api_takes_every_option_as_a_typed_keyword_only_parameter():
    options = _options(gradaudit.audit_step)
    assert "step" in options and "max_norm" in options and "every" in options
    for name, (kind, _, annotation) in options.items():
        assert kind is inspect.Parameter.KEYWORD_ONLY, name
        assert annotation is not inspect.Parameter.empty, name
    session = _options(gradaudit.AuditStep)
    session.pop("capture_api")
    assert options == session
    assert _options(gradaudit.begin_audit) == options
    dumped = _options(gradaudit.dump)
    record = _options(gradaudit.AuditStep.record)
    record.pop("self")
    assert {n: dumped.pop(n) for n in record} == record
    dumped.pop("optimizer")  # accepted only to say that dump takes none
    assert dumped == {n: o for n, o in options.items() if n != "optimizer"}


def test_help_of_audit_step_names_and_documents_every_option():
    text = inspect.getdoc(gradaudit.audit_step) or ""
    for name in _options(gradaudit.audit_step):
        assert f"{name}:" in text or f"{name}," in text, name
