"""What gradaudit's own code imports in a fresh process: its modules, plus every module a gradaudit
module asked for by name. What a third-party package imports for itself (typer loading pydantic,
pydantic loading hashlib) is left out, so that a library release cannot change the answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PROBE = """
import builtins, importlib, json, sys

asked = set()
_import, _import_module = builtins.__import__, importlib.import_module

def _ours(module_globals):
    name = (module_globals or {}).get("__name__") or ""
    return name == "gradaudit" or name.startswith("gradaudit.")

def _recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and _ours(globals):
        asked.add(name)
    return _import(name, globals, locals, fromlist, level)

def _recording_import_module(name, package=None):
    if not name.startswith(".") and _ours(sys._getframe(1).f_globals):
        asked.add(name)
    return _import_module(name, package)

builtins.__import__, importlib.import_module = _recording_import, _recording_import_module

argv = json.loads(sys.argv[1])
code = 0
if argv is None:
    import gradaudit
else:
    from gradaudit.cli import main
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code or 0
sys.stdout.flush()
ours = {m for m in sys.modules if m == "gradaudit" or m.startswith("gradaudit.")}
sys.stderr.write("\\nMODULES " + json.dumps({"code": code, "modules": sorted(ours | asked)}) + "\\n")
"""


def modules_gradaudit_imports(argv: list[str] | None) -> tuple[int, set[str]]:
    """Run `gradaudit ARGV` (or `import gradaudit` for None) in a fresh process; return its exit
    code and the modules that gradaudit loaded or asked for by name."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=300,
        check=False,
    )
    line = next((line for line in done.stderr.splitlines() if line.startswith("MODULES ")), None)
    assert line is not None, done.stderr
    found = json.loads(line.removeprefix("MODULES "))
    return found["code"], set(found["modules"])


def matching(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """The modules that are one of NAMES or inside one of them, sorted."""
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))
