"""DeepSpeed ZeRO 1-3 on 2 gloo ranks (CPU): the partitions reassemble to the single-process gradients."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from deepspeed_workers import deepspeed_runs
from launcher import run_ranks
from models import reference_grads_tiny
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("deepspeed")
    return out_root, run_ranks(deepspeed_runs, 2, (str(out_root),), timeout_s=400)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_partitions_reassemble_to_the_reference_and_audit_clean(runs, stage):
    out_root, results = runs
    name = f"zero{stage}_ok"
    assert [len(r[name]["paths"]) for r in results] == [1, 1]
    step_path = out_root / name / "step_1"
    step = load(step_path)
    grads = reassemble(step, "grad")
    reference = reference_grads_tiny()
    assert sorted(grads) == sorted(reference)
    for param, expected in reference.items():
        assert float((grads[param] - expected.double()).abs().max()) < 1e-5, param
    assert step.clip.reported_norm == pytest.approx(norm_of(grads), rel=1e-5)
    assert error_codes(audit_report(step_path)) == set()
