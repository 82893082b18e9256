"""A real stats-only capture on 4 gloo ranks writes one shared parameter table per distinct table
(a rank lists the parameters it holds a piece of: under FSDP2 the last of 4 ranks holds no row of the
3-row head), every rank names its table, and the step reads back to the single-process norm."""

from __future__ import annotations

import json
import math
import struct

import pytest
import scenarios_shared_params
from launcher import run_ranks
from models import reference_grads_tiny
from reassemble import audit_report, load, norm_of

from gradaudit.dumpfile.paramtable import is_table_file
from gradaudit.dumpfile.schema import METADATA_KEY

pytestmark = pytest.mark.integration

WORLD_SIZE = 4


def _params_entry(path) -> object:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(json.loads(raw[8 : 8 + length])["__metadata__"][METADATA_KEY])["columnar"]["params"]


def test_ranks_capturing_stats_at_once_share_one_parameter_table_and_read_back_the_true_norm(tmp_path):
    results = run_ranks(scenarios_shared_params.fsdp2_stats_only, WORLD_SIZE, (str(tmp_path),), timeout_s=180)
    step_path = tmp_path / "fsdp2_stats_only" / "step_1"
    names = sorted(p.name for p in step_path.iterdir())
    tables = [n for n in names if is_table_file(n)]
    assert names == sorted([*tables, *(f"rank_{r:05d}.safetensors" for r in range(WORLD_SIZE))])
    references = [_params_entry(step_path / f"rank_{r:05d}.safetensors") for r in range(WORLD_SIZE)]
    assert all(isinstance(r, dict) for r in references)
    step = load(step_path)
    by_table: dict[str, set] = {}
    for rank, reference in enumerate(references):
        by_table.setdefault(reference["file"], set()).add(step.ranks[rank].params)
    assert sorted(by_table) == tables  # every table file is named, once per distinct parameter list
    assert all(len(lists) == 1 for lists in by_table.values())
    assert len(tables) == len({d.params for d in step.ranks.values()})
    assert [r["file"] for r in references[:3]] == [references[0]["file"]] * 3  # ranks holding every parameter
    assert step.warnings == () and step.missing_ranks == ()
    sum_sq = math.fsum(p.stats["grad"].sum_sq for d in step.ranks.values() for p in d.pieces)
    true_norm = norm_of({k: v.double() for k, v in reference_grads_tiny().items()})
    assert math.isclose(math.sqrt(sum_sq), true_norm, rel_tol=1e-6)
    assert all(math.isclose(r["returned_norm"], true_norm, rel_tol=1e-5) for r in results)
    report = audit_report(step_path)
    assert report is not None and not [f for f in report.findings if f.severity == "error"]
