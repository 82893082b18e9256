"""Start-up: `--help`, `explain` and `import gradaudit` load only what they print (checked in fresh processes)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cli_runner import Outcome
from import_probe import matching, modules_gradaudit_imports

from gradaudit.checks.registry import CHECKS, DeferredCheck

HEAVY = (
    "torch",
    "numpy",
    "pydantic",
    "safetensors",
    "gradaudit.capture",
    "gradaudit.measure.measure",
    "gradaudit.model",
)


@pytest.mark.parametrize(
    "argv",
    [None, ["--help"], ["explain", "GA201"], ["explain", "--all"]],
    ids=["import gradaudit", "--help", "explain GA201", "explain --all"],
)
def test_help_explain_and_import_load_neither_torch_nor_pydantic_nor_the_checkers(
    argv: list[str] | None,
) -> None:
    code, modules = modules_gradaudit_imports(argv)
    assert code == 0
    assert matching(modules, HEAVY) == []
    check_modules = sorted(m for m in modules if m.startswith("gradaudit.checks.") and m not in _LIGHT_CHECKS)
    assert check_modules == []


_LIGHT_CHECKS = {"gradaudit.checks.registry", "gradaudit.checks.base"}

NOT_FOR_A_PLAIN_CHECK = (
    "torch",
    "safetensors",
    "gradaudit.capture",
    "gradaudit.demo",
    "gradaudit.capture.reference_run",
    "gradaudit.report.inventory",
    "gradaudit.analysis.updates",
    "gradaudit.measure.reference",
    "gradaudit.capture.tensorstats",
    "gradaudit.capture.build",
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
    code, modules = modules_gradaudit_imports(
        ["check", "sample_dumps/fsdp2_local_clip/step_1", "--fail-on", "never"]
    )
    assert code == 0
    assert "gradaudit.checks.norm" in modules  # the probe did run the checks
    assert matching(modules, NOT_FOR_A_PLAIN_CHECK) == []


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
    cli: Callable[..., Outcome],
) -> None:
    code, out, _ = cli("explain", "ga201", "GA202")
    assert code == 0
    assert out.startswith("GA201 (error)") and "\nGA202 (error)" in out
    for argv, problem in (
        (["explain", "GA999"], "unknown code 'GA999'"),
        (["explain", "--frobnicate"], "no such option '--frobnicate'"),
        (["explain", "GA201", "--all"], "not both"),
        (["explain"], "give a code"),
    ):
        code, _, err = cli(*argv)
        assert code == 2 and problem in err and len(err.strip().splitlines()) == 1
