"""torchtitan's clip_grad_norm_ (pp mesh reduction) under 2 pipeline stages x 2 FSDP2 ranks."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.distributed.utils")

from launcher import run_ranks
from models import norm_of as reference_norm_of
from models import reference_grads_tiny
from reassemble import audit_report, error_codes, load, norm_of, reassemble
from torchtitan_workers import torchtitan_runs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("torchtitan")
    return out_root, run_ranks(torchtitan_runs, 4, (str(out_root),), timeout_s=300)


def test_the_norm_reduced_over_the_pp_mesh_audits_clean_and_equals_the_dumps_norm(runs):
    out_root, results = runs
    assert all(len(r["torchtitan_pp_ok"]["paths"]) == 1 for r in results)
    step_path = out_root / "torchtitan_pp_ok" / "step_2"
    assert error_codes(audit_report(step_path)) == set()
    step = load(step_path)
    returned = results[0]["torchtitan_pp_ok"]["norms"][1]
    assert norm_of(reassemble(step, "grad")) == pytest.approx(returned, rel=1e-5)
    assert step.topology.groups["pp"]


def test_the_first_steps_norm_equals_the_single_process_norm(runs):
    _, results = runs
    expected = reference_norm_of(reference_grads_tiny())
    assert all(r["torchtitan_pp_ok"]["norms"][0] == pytest.approx(expected, rel=1e-5) for r in results)


def test_leaving_out_pp_mesh_is_named_as_a_norm_reduced_over_the_wrong_group(runs):
    out_root, _ = runs
    assert "GA203" in error_codes(audit_report(out_root / "torchtitan_pp_stage_norm" / "step_2"))


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    from torchtitan_workers import torchtitan_ep_run

    out_root = tmp_path_factory.mktemp("torchtitan_ep")
    return out_root, run_ranks(torchtitan_ep_run, 2, (str(out_root),), timeout_s=240)


def test_the_ep_and_non_ep_norms_combined_by_torchtitan_audit_clean(ep_run):
    out_root, results = ep_run
    step_path = out_root / "torchtitan_ep_ok" / "step_1"
    step = load(step_path)
    assert norm_of(reassemble(step, "grad")) == pytest.approx(results[0]["norm"], rel=1e-5)
    assert error_codes(audit_report(step_path)) == set()
