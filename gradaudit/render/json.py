"""JSON rendering of a report: stable keys, strings for nonfinite numbers, complete (nothing abbreviated).

The shape is the report schema (`gradaudit/report_schema.json`, described in docs/REPORT.md): the fields
of the report's dataclasses (report/model.py), so a field added there is added to the schema too, with
`REPORT_VERSION` bumped.
Rank lists are runs of consecutive ranks, [first, last] inclusive: complete, and as long as the number
of runs rather than the claimed world size."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..ranksets import rank_runs
from ..report.model import MultiStepReport, Report
from .numbers import json_number

if TYPE_CHECKING:
    from ..report.inventory import RunInventory

_LEFT_OUT = frozenset({"fix"})
"""`Finding.fix`, the line the human renderers print; a JSON reader looks the code up (`gradaudit explain`)."""
_RANK_LISTS = frozenset({"ranks", "ranks_present", "missing_ranks"})
"""Fields holding ranks, written as runs of consecutive ranks (a report's `ranks` holds its rows)."""


_ABSENT_UNLESS_SET = frozenset({"sum_sq_shares", "spike", "spikes"})
"""Optional keys added within report version 3 (a spike dump's `Report.sum_sq_shares`, a trend's
`TrendStep.spike` and `GuardTrend.spikes`): written only when set, so that a report without a spike
keeps its bytes."""
_UNSET = (None, False, ())


_FIELDS: dict[type, tuple[str, ...]] = {}
"""A report dataclass' field names, but the left-out ones (looked up once per class)."""
_AS_IS = frozenset({str, bool, int, type(None)})


def _plain(value: object, name: str = "") -> Any:
    """A report value as JSON values: a dataclass as an object of its fields, an enum as its value,
    tuples as lists (ranks as runs), numbers through `json_number`."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind is float:
        return value if math.isfinite(value) else json_number(value)  # type: ignore[arg-type]
    names = _FIELDS.get(kind)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELDS[kind] = tuple(f.name for f in dataclasses.fields(value) if f.name not in _LEFT_OUT)
    if names is not None:
        return {
            field: _plain(getattr(value, field), field)
            for field in names
            if field not in _ABSENT_UNLESS_SET or getattr(value, field) not in _UNSET
        }
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        if name in _RANK_LISTS and all(isinstance(rank, int) for rank in value):
            return rank_runs(value)
        return [_plain(item) for item in value]
    return json_number(value)


def report_to_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON values; lists keep the report's order."""
    plain: dict[str, Any] = _plain(report)
    return plain


SCHEMA_FILE = "report_schema.json"
"""The JSON Schema of this module's output, shipped inside the package (docs/REPORT.md describes it)."""


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) that every report this version prints validates against."""
    from importlib.resources import files

    schema: dict[str, Any] = json.loads(files("gradaudit").joinpath(SCHEMA_FILE).read_text(encoding="utf-8"))
    return schema


def _dumps(value: dict[str, Any]) -> str:
    # allow_nan=False: a nonfinite float that escaped json_number is a bug, not invalid JSON in the output.
    return json.dumps(value, indent=2, sort_keys=True, allow_nan=False) + "\n"


def render_report(report: Report) -> str:
    return _dumps(report_to_dict(report))


def render_multi(multi: MultiStepReport) -> str:
    return _dumps(_plain(multi))


def render_run_inventory(run: RunInventory) -> str:
    """`gradaudit show --format json` of a run folder: each step's inventory, and the guard's trend
    as the report has it."""
    from ..report.inventory import inventory_to_json

    return _dumps(
        {
            "directory": run.directory,
            "steps": [inventory_to_json(inventory) for inventory in run.steps],
            "guard_trend": _plain(run.guard_trend),
        }
    )
