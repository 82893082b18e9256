"""The Markdown report of every committed sample dump, pinned byte for byte.

Regenerate with `python -m pytest tests/render/test_samples_golden.py --update-goldens` (or
GRADAUDIT_UPDATE_GOLDENS=1) and review the diff; sample_dumps/regenerate.sh rebuilds dumps and goldens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradaudit.cli import main
from gradaudit.demo import scenario_names

REPO = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO / "tests" / "golden_samples"


def _updating(request: pytest.FixtureRequest) -> bool:
    try:
        flag = request.config.getoption("--update-goldens")
    except ValueError:
        flag = False
    return bool(flag) or os.environ.get("GRADAUDIT_UPDATE_GOLDENS") == "1"


def _check_markdown(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["check", *args, "--format", "markdown"])
    return exited.value.code, capsys.readouterr().out


def _assert_golden(markdown: str, golden: Path, request: pytest.FixtureRequest) -> None:
    if _updating(request):
        golden.write_text(markdown, encoding="utf-8")
    assert markdown == golden.read_text(encoding="utf-8"), (
        f"regenerate with --update-goldens and review {golden}"
    )


@pytest.mark.parametrize("scenario", scenario_names())
def test_markdown_report_of_the_sample_dump_is_the_committed_golden(scenario, capsys, monkeypatch, request):
    # The report quotes the command as given: run from the repository root with a relative path.
    monkeypatch.chdir(REPO)
    code, markdown = _check_markdown(capsys, f"sample_dumps/{scenario}/step_1")
    assert code == (0 if scenario == "fsdp2_correct" else 1)
    _assert_golden(markdown, GOLDEN_DIR / f"{scenario}.md", request)


@pytest.mark.parametrize("scenario", ["fsdp2_local_clip", "nonfinite_shard"])
def test_markdown_report_against_the_reference_is_the_committed_golden(
    scenario, capsys, monkeypatch, request
):
    monkeypatch.chdir(REPO)
    code, markdown = _check_markdown(
        capsys, f"sample_dumps/{scenario}/step_1", "--reference", f"sample_dumps/{scenario}/reference/step_1"
    )
    assert code == 1
    _assert_golden(markdown, GOLDEN_DIR / f"{scenario}.reference.md", request)
