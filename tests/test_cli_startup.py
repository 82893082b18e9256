"""Start-up: `--help`, `explain` and `import gradaudit` load only what they print (checked in fresh processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradaudit.checks.registry import CHECKS, DeferredCheck

REPO = Path(__file__).resolve().parents[1]
HEAVY = (
    "torch",
    "numpy",
    "pydantic",
    "safetensors",
    "gradaudit.capture",
    "gradaudit.engine.measure",
    "gradaudit.model",
)

_PROBE = """
import json, sys
argv = json.loads(sys.argv[1])
if argv is None:
    import gradaudit
else:
    from gradaudit.cli import main
    try:
        main(argv)
    except SystemExit as exc:
        assert exc.code == 0, exc.code
sys.stdout.flush()
sys.stderr.write("\\nMODULES " + json.dumps(sorted(sys.modules)) + "\\n")
"""


def _modules_loaded_by(argv: list[str] | None) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=True,
    )
    line = next(line for line in done.stderr.splitlines() if line.startswith("MODULES "))
    return set(json.loads(line.removeprefix("MODULES ")))


def _heavy(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == h or m.startswith(h + ".") for h in HEAVY))


@pytest.mark.parametrize(
    "argv",
    [None, ["--help"], ["explain", "GA201"], ["explain", "--all"]],
    ids=["import gradaudit", "--help", "explain GA201", "explain --all"],
)
def test_help_explain_and_import_load_neither_torch_nor_pydantic_nor_the_checkers(
    argv: list[str] | None,
) -> None:
    modules = _modules_loaded_by(argv)
    assert _heavy(modules) == []
    check_modules = sorted(m for m in modules if m.startswith("gradaudit.checks.") and m not in _LIGHT_CHECKS)
    assert check_modules == []


_LIGHT_CHECKS = {"gradaudit.checks.registry", "gradaudit.checks.base", "gradaudit.checks.explanations"}

NOT_FOR_A_PLAIN_CHECK = (
    "torch",
    "safetensors",
    "gradaudit.capture",
    "gradaudit.demo",
    "gradaudit.reference_run",
    "gradaudit.inventory",
    "gradaudit.updates_explained",
    "gradaudit.engine.reference",
    "gradaudit.engine.tensorstats",
    "gradaudit.dumpfile.build",
    "gradaudit.render.markdown",
    "gradaudit.render.json",
    "gradaudit.render.inventory",
    "concurrent.futures",
    "hashlib",
)
"""What a terminal `check` of a dump without a reference has no use for: capture, the reference
comparison and the other renderers load where they are first needed, a few megabytes of tensors
are read without a thread pool, and only shared parameter tables are hashed."""


def test_a_terminal_check_of_the_toy_dump_loads_no_capture_reference_or_other_renderer() -> None:
    modules = _modules_loaded_by(["check", "sample_dumps/fsdp2_local_clip/step_1", "--fail-on", "never"])
    assert "gradaudit.checks.norm" in modules  # the probe did run the checks
    loaded = sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in NOT_FOR_A_PLAIN_CHECK))
    assert loaded == []


def test_public_names_of_the_package_resolve_on_first_use() -> None:
    import gradaudit

    assert callable(gradaudit.audit_step) and callable(gradaudit.dump)
    assert gradaudit.__version__
    with pytest.raises(AttributeError):
        gradaudit.no_such_name  # noqa: B018


def test_every_row_of_the_check_table_names_a_function_that_exists() -> None:
    for spec in CHECKS:
        assert isinstance(spec.run, DeferredCheck)
        assert callable(spec.run.resolve()), spec.code


def test_explain_prints_several_codes_and_refuses_unknown_codes_and_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gradaudit.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["explain", "ga201", "GA202"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("GA201 (error)") and "\nGA202 (error)" in out
    for argv, problem in (
        (["explain", "GA999"], "unknown code 'GA999'"),
        (["explain", "--frobnicate"], "no such option '--frobnicate'"),
        (["explain", "GA201", "--all"], "not both"),
        (["explain"], "give a code"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and problem in err and len(err.strip().splitlines()) == 1
