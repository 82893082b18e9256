"""The pytest plugin is declared where pip installs it from, and loading it costs an unmarked test nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import json, sys
import pytest
code = pytest.main(sys.argv[1:])
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in ("gradaudit", "torch", "numpy", "safetensors"))
print("PROBE " + json.dumps({"code": int(code), "loaded": loaded}))
"""

PLAIN_TESTS = """
import pytest


@pytest.mark.parametrize("n", [1, 2])
def test_unmarked(n, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("X", str(n))
    print("out", n)
    assert capsys.readouterr().out == f"out {n}\\n"


def test_skipped():
    pytest.skip("as usual")
"""


def test_the_pytest11_entry_point_names_the_plugin_module():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["pytest11"]
    assert declared == {"gradaudit": "gradaudit.testing.plugin"}
    from gradaudit.testing import plugin

    assert callable(plugin.pytest_pyfunc_call) and callable(plugin.gradaudit_rank)


def test_an_install_of_this_tree_registers_the_plugin_with_pytest():
    from importlib import metadata

    try:
        url = json.loads(metadata.distribution("gradaudit").read_text("direct_url.json") or "{}").get(
            "url", ""
        )
    except metadata.PackageNotFoundError:
        url = ""
    if url.removeprefix("file://") != str(REPO):
        pytest.skip(
            f"the installed gradaudit is not this tree ({url or 'none'}); pip install -e . to check it"
        )
    found = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    assert found.get("gradaudit") == "gradaudit.testing.plugin"


def test_loading_the_plugin_imports_no_torch_or_numpy_and_unmarked_tests_run_as_without_it(tmp_path):
    (tmp_path / "test_plain.py").write_text(PLAIN_TESTS)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _PROBE,
            str(tmp_path),
            "-p",
            "gradaudit.testing.plugin",
            "-p",
            "no:cacheprovider",
            "-rs",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    line = next((line for line in done.stdout.splitlines() if line.startswith("PROBE ")), None)
    assert line is not None, done.stdout + done.stderr
    found = json.loads(line.removeprefix("PROBE "))
    assert found["code"] == 0, done.stdout
    assert "2 passed, 1 skipped" in done.stdout
    assert found["loaded"] == ["gradaudit", "gradaudit.testing", "gradaudit.testing.plugin"]
