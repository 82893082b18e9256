"""A valid shared table listing far more parameters than the ranks hold: findings of
one code fold, and `check` (every format) and `show` stay proportional to what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema  # type: ignore[import-untyped]
import pytest
import torch

from gradaudit.capture.build import whole, write_rank
from gradaudit.checks.base import MAX_FINDINGS_PER_CODE, Hit, fold_hits
from gradaudit.model import ClipRecord

from .cli import run_cli

NUM_PARAMS = 20_000


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    """Two stats-mode ranks sharing one table of NUM_PARAMS parameters, of which they hold 4."""
    directory = tmp_path_factory.mktemp("huge") / "step_1"
    params = {f"layers.{i}.w": (4,) for i in range(NUM_PARAMS)}
    for rank in range(2):
        write_rank(
            directory,
            rank=rank,
            world_size=2,
            step=1,
            params=params,
            pieces=[whole(f"layers.{2 * rank + j}.w", grad=torch.ones(4), stats_only=True) for j in range(2)],
            clip=ClipRecord(max_norm=1.0),
        )
    assert len(list(directory.glob("params_*.safetensors"))) == 1
    return directory


@pytest.mark.parametrize("format", ["terminal", "markdown", "json"])
def test_a_table_of_parameters_no_rank_holds_gives_one_gap_finding_in_every_format(step_dir, capsys, format):
    outcome = run_cli(capsys, "check", str(step_dir), "--format", format)
    assert outcome.code == 1, outcome.stderr
    assert len(outcome.stdout) < 30_000  # 20,000 findings before, 6 MB of JSON
    assert f"{NUM_PARAMS - 4} of the step's {NUM_PARAMS} parameters are held by no rank" in " ".join(
        outcome.stdout.split()
    )


def test_the_folded_json_report_is_valid_and_counts_every_parameter(step_dir, capsys):
    outcome = run_cli(capsys, "check", str(step_dir), "--format", "json")
    report = json.loads(outcome.stdout)
    schema = json.loads((Path(__file__).parents[2] / "gradaudit" / "report_schema.json").read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(report)) == []
    (gap,) = [f for f in report["findings"] if f["code"] == "GA103"]
    assert gap["evidence"] == {
        "num_gap_elements": 4 * (NUM_PARAMS - 4),
        "num_params": NUM_PARAMS - 4,
        "numel": 4 * (NUM_PARAMS - 4),
    }
    assert gap["params"] == sorted(f"layers.{i}.w" for i in range(4, NUM_PARAMS))[:10]


def test_show_folds_the_parameters_held_by_nobody_into_one_row(step_dir, capsys):
    outcome = run_cli(capsys, "show", str(step_dir))
    assert outcome.code == 0, outcome.stderr
    assert len(outcome.stdout) < 5_000
    for i in range(4):
        assert f"layers.{i}.w" in outcome.stdout
    assert f"{NUM_PARAMS - 4} parameters held by nobody are folded into one row" in outcome.stdout
    listed = json.loads(run_cli(capsys, "show", str(step_dir), "--format", "json").stdout)
    assert len(listed["params"]) == NUM_PARAMS  # the JSON form is the data: every parameter


def test_more_findings_of_one_code_than_the_limit_fold_into_one_that_counts_the_rest():
    hits = [Hit(message=f"p{i:04d} is wrong", ranks=(i % 7,), params=(f"p{i:04d}",)) for i in range(250)]
    folded = fold_hits(hits)
    assert len(folded) == MAX_FINDINGS_PER_CODE
    rest = folded[-1]
    assert rest.evidence == {
        "folded_findings": 250 - (MAX_FINDINGS_PER_CODE - 1),
        "folded_params": 250 - (MAX_FINDINGS_PER_CODE - 1),
    }
    assert set(rest.ranks) == {r for hit in hits if hit not in folded[:-1] for r in hit.ranks}
    assert len(rest.params) == 10 and str(250 - (MAX_FINDINGS_PER_CODE - 1)) in rest.message
    assert fold_hits(hits[:MAX_FINDINGS_PER_CODE]) == tuple(hits[:MAX_FINDINGS_PER_CODE])
