"""JSON rendering of a report: stable keys, strings for nonfinite numbers, complete (nothing abbreviated).

The shape is the report schema (`gradaudit/report_schema.json`, described in docs/REPORT.md); change both
together and bump `REPORT_VERSION`.
Rank lists are runs of consecutive ranks, [first, last] inclusive: complete, and as long as the number
of runs rather than the claimed world size."""

from __future__ import annotations

import json
from typing import Any

from ..ranksets import rank_runs
from ..report.model import (
    Environment,
    Finding,
    MultiStepReport,
    NonfiniteCounts,
    ParamComparison,
    RankRow,
    Report,
    StepSummary,
    TopologySummary,
)
from .numbers import json_number


def _nonfinite_to_dict(counts: NonfiniteCounts) -> dict[str, int]:
    return {"nan": counts.nan, "posinf": counts.posinf, "neginf": counts.neginf}


def _rank_to_dict(row: RankRow) -> dict[str, Any]:
    return {
        "rank": row.rank,
        "local_norm": json_number(row.local_norm),
        "reported_norm": json_number(row.reported_norm),
        "applied_clip_coef": json_number(row.applied_clip_coef),
        "applied_coef_source": row.applied_coef_source,
        "diagnosis": row.diagnosis,
        "diagnosis_detail": row.diagnosis_detail,
        "share_of_squared_norm": json_number(row.share_of_squared_norm),
        "nonfinite": _nonfinite_to_dict(row.nonfinite),
    }


def _finding_to_dict(finding: Finding) -> dict[str, Any]:
    return {
        "code": finding.code,
        "severity": finding.severity.value,
        "title": finding.title,
        "message": finding.message,
        "ranks": rank_runs(finding.ranks),
        "params": list(finding.params),
        "evidence": {str(key): json_number(value) for key, value in finding.evidence.items()},
    }


def _comparison_to_dict(comparison: ParamComparison) -> dict[str, Any]:
    return {
        "param": comparison.param,
        "kind": comparison.kind,
        "max_abs_error": json_number(comparison.max_abs_error),
        "max_rel_error": json_number(comparison.max_rel_error),
        "atol": json_number(comparison.atol),
        "rtol": json_number(comparison.rtol),
        "within_tolerance": comparison.within_tolerance,
    }


def environment_to_dict(env: Environment) -> dict[str, Any]:
    return {
        "auditor_version": env.auditor_version,
        "dump_versions": list(env.dump_versions),
        "torch_versions": list(env.torch_versions),
        "hosts": list(env.hosts),
        "modes": list(env.modes),
        "world_size": env.world_size,
        "run_ids": list(env.run_ids),
    }


def topology_to_dict(topology: TopologySummary) -> dict[str, Any]:
    mesh = topology.mesh
    return {
        "groups": {name: [list(ranks) for ranks in lists] for name, lists in topology.groups.items()},
        "mesh": None if mesh is None else {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names)},
        "norm_group": topology.norm_group,
    }


def report_to_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON values; lists keep the report's order."""
    return {
        "report_version": report.report_version,
        "step": report.step,
        "world_size": report.world_size,
        "ranks_present": rank_runs(report.ranks_present),
        "missing_ranks": rank_runs(report.missing_ranks),
        "norm_type": json_number(report.norm_type),
        "max_norm": json_number(report.max_norm),
        "global_norm": json_number(report.global_norm),
        "expected_clip_coef": json_number(report.expected_clip_coef),
        "verdict": report.verdict,
        "ranks": [_rank_to_dict(row) for row in report.ranks],
        "findings": [_finding_to_dict(finding) for finding in report.findings],
        "not_checked": [{"code": n.code, "title": n.title, "reason": n.reason} for n in report.not_checked],
        "reference": [_comparison_to_dict(c) for c in report.reference],
        "environment": environment_to_dict(report.environment),
        "topology": topology_to_dict(report.topology),
        "command": report.command,
        "warnings": list(report.warnings),
    }


def _summary_to_dict(summary: StepSummary) -> dict[str, Any]:
    return {
        "step": summary.step,
        "directory": summary.directory,
        "global_norm": json_number(summary.global_norm),
        "reported_norm": json_number(summary.reported_norm),
        "expected_clip_coef": json_number(summary.expected_clip_coef),
        "num_errors": summary.num_errors,
        "num_warnings": summary.num_warnings,
        "codes": list(summary.codes),
    }


def multi_to_dict(multi: MultiStepReport) -> dict[str, Any]:
    return {
        "report_version": multi.report_version,
        "directory": multi.directory,
        "summary": [_summary_to_dict(s) for s in multi.summary],
        "steps": [report_to_dict(report) for report in multi.steps],
    }


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
    return _dumps(multi_to_dict(multi))
