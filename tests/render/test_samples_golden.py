"""The Markdown report of every committed sample dump, pinned byte for byte.

Regenerate with `python -m pytest tests/render/test_samples_golden.py --update-goldens` (or
GRADAUDIT_UPDATE_GOLDENS=1) and review the diff; sample_dumps/regenerate.sh rebuilds dumps and goldens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from goldens import SAMPLE_GOLDENS, assert_golden

from gradaudit.demo import scenario_names

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("scenario", scenario_names())
def test_markdown_report_of_the_sample_dump_is_the_committed_golden(scenario, cli, monkeypatch, request):
    # The report quotes the command as given: run from the repository root with a relative path.
    monkeypatch.chdir(REPO)
    code, markdown, _ = cli("check", f"sample_dumps/{scenario}/step_1", "--format", "markdown")
    assert code == (0 if scenario == "fsdp2_correct" else 1)
    assert_golden(request, SAMPLE_GOLDENS / f"{scenario}.md", markdown)


@pytest.mark.parametrize("scenario", ["fsdp2_local_clip", "nonfinite_shard"])
def test_markdown_report_against_the_reference_is_the_committed_golden(scenario, cli, monkeypatch, request):
    monkeypatch.chdir(REPO)
    reference = f"sample_dumps/{scenario}/reference/step_1"
    code, markdown, _ = cli(
        "check", f"sample_dumps/{scenario}/step_1", "--reference", reference, "--format", "markdown"
    )
    assert code == 1
    assert_golden(request, SAMPLE_GOLDENS / f"{scenario}.reference.md", markdown)
