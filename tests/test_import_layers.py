"""The layout by stage holds: no module imports a stage to its right, the offline audit never imports
the capture, and no import cycle exists (docs/ARCHITECTURE.md states the rule)."""

from __future__ import annotations

import ast
from pathlib import Path

import gradaudit

PACKAGE = Path(gradaudit.__file__).parent

VOCABULARY = ("model", "norms", "ranksets", "errors", "version", "warn", "steptable")
"""Top-level modules every stage may import; they import only each other."""

STAGES = ("dumpfile", "capture", "measure", "analysis", "report", "checks", "render")
"""Folders in import order: each imports only the vocabulary, itself and the stages to its left.
The dump format comes first because both sides use it (the capture writes it, the audit reads it);
the report's values come before the checks because a finding is a report value."""

OFFLINE = ("measure", "analysis", "report", "checks", "render")
"""Stages of the offline audit, which never load the training-side capture code."""

BEYOND_THE_TABLE = ("report", "checks", "render")
"""Stages that see a step only through the analysis value (checks.base.Analysis: the step table, the
diagnosis, ...) and its report: they import nothing of the file format or of measuring."""

SHELLS = (
    "__main__",
    "audit",  # assembles the offline stages
    "cli",  # prints and exits
    "cliparams",  # the CLI's option conversions
    "reportfile",  # writes a rendered report to --output
    "scaleout",  # torchrun: loading and measuring shared among processes
    "progress",  # the progress bar
    "integrations",  # framework callbacks around the capture and the guard
    "testing",  # check_clip_parity runs a capture and an audit on gloo ranks
    "demo",  # writes a dump and checks it
    "localranks",  # local CPU rank processes for the demo and the test helpers
    "live",  # the guard: training-side hooks (capture) that run the offline analysis (audit) on every step
)
"""Top-level modules and folders that assemble stages; they may import anything, and no stage imports them."""


def _module_name(path: Path) -> str:
    parts = ["gradaudit", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Every gradaudit module -> the gradaudit modules it imports anywhere (top level, inside
    functions and under TYPE_CHECKING alike)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in modules else module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def _stage(module: str) -> str:
    """The stage of a module: its folder, "vocabulary", "shell" (SHELLS and the package itself), or
    "unplaced" (a new top-level module or folder nobody has placed yet)."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in SHELLS:
        return "shell"
    if parts[1] in STAGES:
        return parts[1]
    return "vocabulary" if len(parts) == 2 and parts[1] in VOCABULARY else "unplaced"


def _allowed(importer: str, imported: str) -> bool:
    a, b = _stage(importer), _stage(imported)
    if "unplaced" in (a, b):
        return False
    if a == "shell":
        return True
    if a == "vocabulary":
        return b == "vocabulary"
    if b == "vocabulary":
        return True
    if b == "shell":
        return False
    if a in OFFLINE and b == "capture":
        return False
    if a in BEYOND_THE_TABLE and b in ("dumpfile", "measure"):
        return False
    return STAGES.index(b) <= STAGES.index(a)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_stage_imports_a_stage_to_its_right_and_the_offline_audit_never_imports_the_capture() -> None:
    graph = _imports()
    assert len(graph) > 50  # the walk found the package
    wrong = sorted(
        f"{importer} imports {imported}"
        for importer, imported_set in graph.items()
        for imported in imported_set
        if not _allowed(importer, imported)
    )
    assert wrong == []


def test_every_module_has_a_place_in_the_layout() -> None:
    unplaced = sorted(m for m in _imports() if _stage(m) == "unplaced")
    assert unplaced == []  # a new top-level module or folder: add it to STAGES, VOCABULARY or SHELLS


def test_no_import_cycle_exists() -> None:
    assert _cycles(_imports()) == []


def test_the_cycle_finder_finds_a_cycle_and_the_rule_refuses_a_backward_import() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert not _allowed("gradaudit.measure.measure", "gradaudit.checks.base")
    assert not _allowed("gradaudit.checks.norm", "gradaudit.capture.tensorstats")
    assert not _allowed("gradaudit.model", "gradaudit.dumpfile.header")
    assert not _allowed("gradaudit.render.json", "gradaudit.audit")
    assert _allowed("gradaudit.checks.norm", "gradaudit.analysis.diagnosis")
    assert _allowed("gradaudit.capture.write", "gradaudit.dumpfile.writer")
    assert _allowed("gradaudit.cli", "gradaudit.capture.session")
    assert _allowed("gradaudit.live.guard", "gradaudit.audit")
    assert not _allowed("gradaudit.checks.norm", "gradaudit.live.analysis_input")
    assert not _allowed("gradaudit.checks.replicas", "gradaudit.measure.measurements")
    assert not _allowed("gradaudit.checks.coverage", "gradaudit.dumpfile.header")
    assert _allowed("gradaudit.checks.replicas", "gradaudit.steptable")
    assert _stage("gradaudit.newthing") == "unplaced"
