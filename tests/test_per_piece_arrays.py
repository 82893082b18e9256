"""The classes that may hold numpy arrays are named here: a new one is a decision, not an accident.

Per-piece data has one form per stage (columns); a class that starts holding arrays of its own is a
second form that the rest of the package must be kept in step with. The scan reads gradaudit/ with
ast: a class holds arrays when an annotation in its body, or on `self.x` in one of its methods, names
a numpy array (np.ndarray, numpy.ndarray, NDArray, or an alias of one, found across the package:
`F64 = npt.NDArray[np.float64]`, `Pair = tuple["np.ndarray", "np.ndarray"]`), anywhere inside it
(strings, `X | None`, Optional, tuple[...], Mapping[..., X]); or when a method sets `self.x` to
what a `np.` or `numpy.` call returns.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gradaudit"
ARRAY_NAMES = frozenset({"ndarray", "NDArray"})

ALLOWED = {
    # each parameter's term of the norm, sorted, for the listed-twice hypothesis
    "gradaudit.analysis.hypotheses.ParamTerms",
    # the diagnosis's terms of the p-norm, one per entry, in (rank, entry) order
    "gradaudit.analysis.norm_input.Entries",
    # everything numeric the diagnosis reads of a step
    "gradaudit.analysis.norm_input.NormInput",
    # the guard's gathered numbers, one row per rank and group it holds, in rank order: sorted into
    # the step table
    "gradaudit.live.analysis_input._Gathered",
    # capture: the rows of a rank's pieces that hold a whole plain tensor, by position, read in bulk
    "gradaudit.capture.plain.WholeRows",
    # capture: the stats mode's float64 rows, one per piece and kind
    "gradaudit.capture.snapshots.StatsTable",
    # capture: the columns the dump builder takes, filled a block at a time
    "gradaudit.capture.write._Columns",
    # format 1.1: decoded parameter and piece tables shared by the ranks of one load
    "gradaudit.dumpfile.columnar.ParamsCache",
    # format 1.1: parameter indices into one list of names shared by a step's ranks
    "gradaudit.dumpfile.columnar.ParamIds",
    # format 1.1: what the extent checks read of a table of regions
    "gradaudit.dumpfile.columnar._Extents",
    # format 1.1: statistics entries as columns, while they are checked
    "gradaudit.dumpfile.columnar._StatsColumns",
    # format 1.1: the pieces' regions as one table, while they are checked
    "gradaudit.dumpfile.columnar._Regions",
    # reusable float64 buffers for widening raw chunks (not per piece)
    "gradaudit.dumpfile.dtypes.Widener",
    # a reusable read buffer (not per piece)
    "gradaudit.dumpfile.reader.TensorReader",
    # a reference parameter's values, assembled densely when sharded (not per piece)
    "gradaudit.measure.reference.ReferenceSource",
    # every piece of the chosen parameters of a step, ordered by parameter then rank
    "gradaudit.measure.table.PieceTable",
    # a rank's pieces as columns: the format 1.1 layout, the model's one columnar form
    "gradaudit.dumpfile.dump.ColumnarPieces",
    # the columns of pieces while they are filled, before ColumnarPieces
    "gradaudit.dumpfile.dump.PieceColumnsBuilder",
    # the step table: every measured piece (or the guard's ownership group) of a step, frozen columns
    "gradaudit.steptable.StepTable",
    # one tensor kind's statistics in the step table, one value per entry
    "gradaudit.steptable.KindColumns",
    # one parameter's dense arrays for the update judgement (not per piece)
    "gradaudit.steptable.DenseUpdate",
}


def _name_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _parse_string_annotation(text: str) -> ast.expr | None:
    try:
        return ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None


def type_names(expr: ast.expr) -> Iterator[str]:
    """Every name a type expression mentions, inside string annotations too, but not inside Literal[...]."""
    if isinstance(expr, ast.Constant):
        parsed = _parse_string_annotation(expr.value) if isinstance(expr.value, str) else None
        if parsed is not None:
            yield from type_names(parsed)
        return
    name = _name_of(expr)
    if name is not None:
        yield name
    if isinstance(expr, ast.Subscript) and _name_of(expr.value) == "Literal":
        return
    for child in ast.iter_child_nodes(expr):
        if isinstance(child, ast.expr):
            yield from type_names(child)


def _is_type_expression(expr: ast.expr) -> bool:
    if isinstance(expr, ast.BinOp):
        return isinstance(expr.op, ast.BitOr)
    return isinstance(expr, ast.Name | ast.Attribute | ast.Subscript) or (
        isinstance(expr, ast.Constant) and isinstance(expr.value, str)
    )


def _module_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """A module's statements, those under `if` (TYPE_CHECKING, version tests) and `try` included."""
    for statement in body:
        yield statement
        if isinstance(statement, ast.If):
            yield from _module_statements(statement.body)
            yield from _module_statements(statement.orelse)
        elif isinstance(statement, ast.Try):
            yield from _module_statements(statement.body)


def _alias_definitions(tree: ast.Module) -> Iterator[tuple[str, ast.expr]]:
    type_alias = getattr(ast, "TypeAlias", None)  # `type X = ...`, Python 3.12
    for statement in _module_statements(tree.body):
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        elif type_alias is not None and isinstance(statement, type_alias):
            target, value = statement.name, statement.value
        else:
            continue
        if isinstance(target, ast.Name) and _is_type_expression(value):
            yield target.id, value


def array_aliases(trees: dict[str, ast.Module]) -> frozenset[str]:
    """The names that stand for an array type anywhere in the package, aliases of aliases included
    (by name: an alias imported under its own name is the same alias)."""
    definitions = [definition for tree in trees.values() for definition in _alias_definitions(tree)]
    names = set(ARRAY_NAMES)
    while True:
        new = {
            name
            for name, value in definitions
            if name not in names and not names.isdisjoint(type_names(value))
        }
        if not new:
            return frozenset(names)
        names |= new


def _is_numpy_call(expr: ast.expr) -> bool:
    return (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and isinstance(expr.func.value, ast.Name)
        and expr.func.value.id in {"np", "numpy"}
    )


def _self_assignments(method: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.expr, ast.expr]]:
    """(target, value) of every assignment in a method, tuples unpacked pairwise."""
    for node in ast.walk(method):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    yield from zip(target.elts, node.value.elts, strict=False)
                else:
                    yield target, node.value


def array_attributes(cls: ast.ClassDef, aliases: frozenset[str]) -> list[str]:
    """The fields and attributes of a class that hold numpy arrays (see the module docstring)."""
    found = []
    for statement in cls.body:
        if isinstance(statement, ast.AnnAssign) and not aliases.isdisjoint(type_names(statement.annotation)):
            found.append(ast.unparse(statement.target))
        if not isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef) or not statement.args.args:
            continue
        me = statement.args.args[0].arg

        def on_self(target: ast.expr, me: str = me) -> bool:
            return (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == me
            )

        found.extend(
            ast.unparse(node.target)
            for node in ast.walk(statement)
            if isinstance(node, ast.AnnAssign)
            and on_self(node.target)
            and not aliases.isdisjoint(type_names(node.annotation))
        )
        found.extend(
            ast.unparse(t) for t, v in _self_assignments(statement) if on_self(t) and _is_numpy_call(v)
        )
    return found


def _classes(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.ClassDef]]:
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield f"{prefix}.{node.name}", node
            yield from _classes(node.body, f"{prefix}.{node.name}")
        elif isinstance(node, ast.If | ast.Try):
            yield from _classes(node.body, prefix)


def classes_holding_arrays(package: Path) -> dict[str, list[str]]:
    trees = {
        ".".join(path.relative_to(package.parent).with_suffix("").parts): ast.parse(
            path.read_text(encoding="utf-8")
        )
        for path in sorted(package.rglob("*.py"))
    }
    aliases = array_aliases(trees)
    holding = {}
    for module, tree in trees.items():
        for name, cls in _classes(tree.body, module.removesuffix(".__init__")):
            attributes = array_attributes(cls, aliases)
            if attributes:
                holding[name] = attributes
    return holding


def test_only_the_named_classes_hold_numpy_arrays() -> None:
    holding = classes_holding_arrays(PACKAGE)
    new = sorted(set(holding) - ALLOWED)
    gone = sorted(ALLOWED - set(holding))
    assert not new, (
        "these classes now hold numpy arrays: "
        + "; ".join(f"{name} ({', '.join(holding[name])})" for name in new)
        + ". Per-piece data has one columnar form per stage: use it, or add the class to ALLOWED in "
        "tests/test_per_piece_arrays.py with a line saying what it holds and why it is not that form."
    )
    assert not gone, f"these classes no longer hold numpy arrays: remove them from ALLOWED: {gone}"


SYNTHETIC = """
from __future__ import annotations
from dataclasses import dataclass
from typing import NamedTuple, Optional, Literal, TYPE_CHECKING
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    FloatArray = npt.NDArray[np.float64]
Pair = tuple["np.ndarray", "np.ndarray"]
PairOrNone = Pair | None
CODES = {"FloatArray": 1}
Kind = Literal["FloatArray", "np.ndarray"]

@dataclass(frozen=True)
class Annotated:
    values: "FloatArray"

class Optional_(NamedTuple):
    values: Optional[np.ndarray]

class Union_:
    values: numpy.ndarray | None

class InTuple:
    values: tuple[np.ndarray, ...]

class InMapping:
    values: "Mapping[str, npt.NDArray[np.int64]]"

class ByAlias:
    pair: PairOrNone

class Outer:
    class Inner:
        def __init__(self) -> None:
            self.values: FloatArray | None = None

class Assigned:
    def __init__(self, n: int) -> None:
        self.count, self.values = n, np.zeros(n)

class Plain:
    kind: Kind
    count: int
    def __init__(self) -> None:
        self.total = sum([1, 2])
        values: np.ndarray = np.zeros(3)  # a local, not an attribute
"""


def test_the_scan_finds_arrays_behind_strings_unions_containers_and_aliases(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(SYNTHETIC)
    holding = classes_holding_arrays(package)
    assert holding == {
        "pkg.mod.Annotated": ["values"],
        "pkg.mod.Optional_": ["values"],
        "pkg.mod.Union_": ["values"],
        "pkg.mod.InTuple": ["values"],
        "pkg.mod.InMapping": ["values"],
        "pkg.mod.ByAlias": ["pair"],
        "pkg.mod.Outer.Inner": ["self.values"],
        "pkg.mod.Assigned": ["self.values"],
    }


@pytest.mark.parametrize("alias", ["F64", "Mask"])
def test_the_packages_own_array_aliases_are_known(alias: str) -> None:
    trees = {str(path): ast.parse(path.read_text(encoding="utf-8")) for path in PACKAGE.rglob("*.py")}
    assert alias in array_aliases(trees)
