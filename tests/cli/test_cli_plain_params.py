"""`gradaudit check` converts its options without typer's pydantic adapters: same values, same
usage errors, no pydantic loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer.core

from gradaudit.cli import FailOn, OutputFormat
from gradaudit.cliparams import plain_param

REPO = Path(__file__).resolve().parents[2]
TOY = "sample_dumps/fsdp2_local_clip/step_1"


@pytest.mark.skipif(
    not hasattr(typer.core, "_TyperParameter"), reason="this typer has no lazy converter slot to fill"
)
@pytest.mark.parametrize("fmt", ["terminal", "json", "markdown"])
def test_a_check_loads_neither_pydantic_nor_typers_adapters(fmt: str) -> None:
    probe = (
        "import io, json, sys, contextlib\n"
        "from gradaudit.cli import main\n"
        "try:\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        f"        main(['check', {TOY!r}, '--fail-on', 'never', '--format', {fmt!r}, '--rtol', '1e-4'])\n"
        "except SystemExit as exc:\n"
        "    code = exc.code\n"
        "print(json.dumps([code, sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic'"
        " or m == 'typer._adapters')]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    code, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert code == 0 and loaded == []


def test_plain_conversion_gives_what_the_command_declares() -> None:
    assert plain_param(Path | None).coerce("a/b", param=None, ctx=None) == Path("a/b")
    assert plain_param(OutputFormat).coerce("json", param=None, ctx=None) is OutputFormat.json
    assert plain_param(FailOn).coerce(FailOn.never, param=None, ctx=None) is FailOn.never
    assert plain_param(float | None).coerce("1e-3", param=None, ctx=None) == 1e-3
    assert plain_param(float | None).coerce(None, param=None, ctx=None) is None
    assert plain_param(list[int]) is None  # anything else is left to typer


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--format", "yaml"], "'yaml' is not one of 'terminal', 'markdown', 'json'"),
        (["--rtol", "tight"], "'tight' is not a number"),
        (["--fail-on", "sometimes"], "is not one of 'error', 'warning', 'never'"),
    ],
)
def test_a_bad_value_is_a_usage_error_naming_the_option(argv, says, cli, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    code, _, err = cli("check", TOY, *argv)
    assert code == 2
    assert says in err
