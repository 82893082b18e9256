"""Each committed sample dump, checked with and without its unsharded reference, gives exactly the
finding codes its mistake should produce (and the correct scenario no error)."""

from __future__ import annotations

import pytest
from samples import check_json, codes, reference_dir, step_dir

from gradaudit.demo import scenario_names

# scenario: (codes of `gradaudit check`, codes that `--reference` adds), duplicates included.
EXPECTED = {
    "fsdp2_correct": (["GA701"], []),
    "fsdp2_local_clip": (["GA201", "GA302", "GA303", "GA701"], ["GA603", "GA603"]),
    "hsdp_world_allreduce": (["GA202", "GA302", "GA701"], ["GA603", "GA603"]),
    "tp_layernorm_double_count": (["GA202", "GA302", "GA701"], ["GA603", "GA603"]),
    "pipeline_stage_norm": (["GA203", "GA301", "GA302", "GA303", "GA701"], ["GA603", "GA603"]),
    "nonfinite_shard": (["GA401"], ["GA602", "GA602", "GA603", "GA603"]),
    "clip_before_unscale": (["GA302", "GA502", "GA701"], ["GA603", "GA603"]),
    "clip_per_microbatch": (["GA501", "GA701"], ["GA602", "GA602", "GA603", "GA603"]),
    "ddp_drifted_replicas": (["GA301", "GA601", "GA701"], ["GA602", "GA602", "GA603", "GA603"]),
}

DIAGNOSES = {
    "fsdp2_correct": {"correct"},
    "fsdp2_local_clip": {"local_only"},
    "hsdp_world_allreduce": {"replicas_double_counted"},
    "tp_layernorm_double_count": {"replicas_double_counted"},
    "pipeline_stage_norm": {"wrong_group:dp"},
}
"""The diagnosis every rank of the scenario must get, where the scenario is about the norm's accounting."""

INFO_CODES = {"GA701"}


def test_every_scenario_has_its_expected_findings_listed():
    assert sorted(EXPECTED) == sorted(scenario_names())


@pytest.mark.parametrize("scenario", scenario_names())
def test_sample_dump_gives_exactly_the_expected_findings(scenario, capsys):
    alone, added = EXPECTED[scenario]
    report = check_json(capsys, step_dir(scenario))
    assert codes(report) == alone
    assert {f["severity"] for f in report["findings"] if f["code"] in INFO_CODES} <= {"info"}
    assert all(f["severity"] == "error" for f in report["findings"] if f["code"] not in INFO_CODES)
    with_reference = check_json(capsys, step_dir(scenario), reference_dir(scenario))
    assert codes(with_reference) == sorted(alone + added)


def test_the_correct_fsdp2_step_has_no_error_and_matches_its_reference_everywhere(capsys):
    report = check_json(capsys, step_dir("fsdp2_correct"), reference_dir("fsdp2_correct"))
    assert codes(report, "error") == []
    assert report["reference"] and all(c["within_tolerance"] for c in report["reference"])
    assert {c["kind"] for c in report["reference"]} == {"grad", "grad_clipped", "param_after"}


@pytest.mark.parametrize("scenario", sorted(DIAGNOSES))
def test_every_rank_of_the_sample_gets_the_scenario_diagnosis(scenario, capsys):
    report = check_json(capsys, step_dir(scenario))
    assert {row["diagnosis"] for row in report["ranks"]} == DIAGNOSES[scenario]


def test_pipeline_stages_applied_two_different_coefficients_by_stage(capsys):
    report = check_json(capsys, step_dir("pipeline_stage_norm"))
    coef = {row["rank"]: row["applied_clip_coef"] for row in report["ranks"]}
    assert coef[0] == pytest.approx(coef[1]) and coef[2] == pytest.approx(coef[3])
    assert coef[0] != pytest.approx(coef[2], rel=1e-3)
    assert report["global_norm"] > report["max_norm"]


def test_replicas_double_counted_under_hsdp_inflate_the_norm_by_the_square_root_of_two(capsys):
    report = check_json(capsys, step_dir("hsdp_world_allreduce"))
    for row in report["ranks"]:
        assert row["reported_norm"] == pytest.approx(2**0.5 * report["global_norm"], rel=1e-5)


def test_clip_per_microbatch_records_one_clip_call_per_microbatch(capsys):
    report = check_json(capsys, step_dir("clip_per_microbatch"))
    (finding,) = [f for f in report["findings"] if f["code"] == "GA501"]
    assert finding["ranks"] == [[0, 1]]
    assert finding["evidence"]["num_calls"] == 2


@pytest.mark.parametrize("scenario", scenario_names())
def test_demo_list_announces_exactly_the_pinned_error_codes(scenario):
    import re

    from gradaudit.demo import get_scenario

    alone, added = EXPECTED[scenario]
    announced = set(re.findall(r"GA\d{3}", get_scenario(scenario).expected))
    assert announced == set(alone + added) - INFO_CODES
