"""The JSON report against its schema (gradaudit/report_schema.json): every golden report, every sample
dump's report, and the schema's own version against the report version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest
from samples import check_json

from gradaudit.demo import scenario_names
from gradaudit.render import json as json_render
from gradaudit.report.model import REPORT_VERSION

REPO = Path(__file__).resolve().parents[2]
GOLDEN_JSON = sorted((REPO / "tests" / "golden").glob("*.json"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.protocols.Validator:
    schema = json_render.report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator: jsonschema.protocols.Validator, document: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_the_schema_ships_inside_the_package_and_names_the_current_report_version() -> None:
    schema = json_render.report_schema()
    assert schema["$defs"]["report"]["properties"]["report_version"] == {"const": REPORT_VERSION}
    assert schema["$defs"]["multi_step_report"]["properties"]["report_version"] == {"const": REPORT_VERSION}
    assert schema["$id"].endswith(f"/{REPORT_VERSION}")
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert json_render.SCHEMA_FILE in pyproject


@pytest.mark.parametrize("golden", GOLDEN_JSON, ids=[p.name for p in GOLDEN_JSON])
def test_every_golden_json_report_validates_against_the_schema(
    validator: jsonschema.protocols.Validator, golden: Path
) -> None:
    assert _errors(validator, json.loads(golden.read_text(encoding="utf-8"))) == []


@pytest.mark.parametrize("scenario", scenario_names())
def test_the_report_of_every_sample_dump_validates_against_the_schema(
    validator: jsonschema.protocols.Validator, scenario: str, capsys: pytest.CaptureFixture[str]
) -> None:
    samples = REPO / "sample_dumps" / scenario
    report = check_json(capsys, samples / "step_1")
    assert _errors(validator, report) == []
    assert isinstance(report["environment"]["world_size"], int)
    assert all(
        isinstance(rank, int)
        for groups in report["topology"]["groups"].values()
        for g in groups
        for rank in g
    )
    if (samples / "reference" / "step_1").is_dir():
        compared = check_json(capsys, samples / "step_1", samples / "reference" / "step_1")
        assert _errors(validator, compared) == []


def test_a_folder_of_steps_gives_a_multi_step_report_that_validates(
    validator: jsonschema.protocols.Validator, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import shutil

    for step in (1, 2):
        shutil.copytree(REPO / "sample_dumps" / "fsdp2_correct" / "step_1", tmp_path / f"step_{step}")
    report = check_json(capsys, tmp_path)
    assert len(report["steps"]) == 2
    assert _errors(validator, report) == []


def test_the_schema_refuses_display_strings_where_numbers_belong(
    validator: jsonschema.protocols.Validator,
) -> None:
    document = json.loads((REPO / "tests" / "golden" / "seed.json").read_text(encoding="utf-8"))
    document["environment"]["world_size"] = "4"
    assert any("world_size" in error for error in _errors(validator, document))
    document["environment"]["world_size"] = 4
    document["topology"]["groups"]["dp_shard"] = "[0, 1, 2, 3]"
    assert _errors(validator, document) != []
