"""Verdicts on partial evidence: missing ranks give bounds (and say so), and a dump that cannot show
what clipping did says "clipping not checked" instead of passing."""

from __future__ import annotations

import shutil

import torch
from builders import box, check, clip, codes, not_checked, sharded_rows, tensor_with_norm, write_step

from gradaudit.model import Topology


def _four_shards():
    return [tensor_with_norm(0.8, (2, 3), seed=r, dtype=torch.float64) for r in range(4)]


def _without(directory, *ranks):
    for rank in ranks:
        (directory / f"rank_{rank:05d}.safetensors").unlink()
    return directory


def test_one_missing_rank_is_named_in_the_singular_and_the_local_norm_is_still_named(tmp_path):
    sharded_rows(tmp_path, _four_shards(), clips=clip(1.0, reported_norm=0.8, clip_coef=1.0))
    report = check(_without(tmp_path, 2))
    assert "rank 2 is missing" in report.verdict and "at least 1.38564" in report.verdict
    assert "GA201" in codes(report) and "GA204" not in codes(report)
    ga201 = next(f for f in report.findings if f.code == "GA201")
    assert ga201.ranks == (0, 1, 3) and "a lower bound from the present ranks" in ga201.message
    assert abs(ga201.evidence["true_norm_lower_bound"] - (3 * 0.64) ** 0.5) < 1e-9
    ga302 = next(f for f in report.findings if f.code == "GA302")
    assert "asks for a coefficient of at most" in ga302.message


def test_two_missing_ranks_are_named_as_a_range(tmp_path):
    sharded_rows(tmp_path, _four_shards(), clips=clip(1.0, reported_norm=0.8, clip_coef=1.0))
    report = check(_without(tmp_path, 2, 3))
    assert "ranks 2-3 are missing" in report.verdict
    assert {row.diagnosis for row in report.ranks} == {"local_only"}


def test_a_reported_norm_not_below_the_bound_is_left_undecided_with_a_missing_rank(tmp_path):
    true_norm = 1.6
    sharded_rows(tmp_path, _four_shards(), clips=clip(1.0, reported_norm=true_norm))
    report = check(_without(tmp_path, 3))
    assert not codes(report) & {"GA201", "GA202", "GA203", "GA204", "GA302"}
    assert "GA201" in not_checked(report)
    assert report.ranks[0].diagnosis is None and "may be the true norm" in report.ranks[0].diagnosis_detail


def test_a_local_norm_that_a_partly_missing_group_could_also_give_is_not_named(tmp_path):
    grads = _four_shards()
    pieces = {r: [box("w", (2 * r, 0), grad=g)] for r, g in enumerate(grads)}
    write_step(
        tmp_path,
        world_size=4,
        params={"w": (8, 3)},
        pieces=pieces,
        clips=clip(1.0, reported_norm=0.8),
        topology=Topology(groups={"pair": ((0, 1), (2, 3))}),
    )
    report = check(_without(tmp_path, 1))
    row = next(r for r in report.ranks if r.rank == 0)
    assert row.diagnosis is None and "group pair" in row.diagnosis_detail
    ga201 = next(f for f in report.findings if f.code == "GA201")
    assert ga201.ranks == (2, 3)


def test_a_single_further_finding_is_counted_in_the_singular(tmp_path):
    sharded_rows(tmp_path, _four_shards(), clips=clip(1.0, reported_norm=0.8))
    report = check(tmp_path)
    assert report.verdict.endswith("(and 1 more finding).")


def test_a_dump_with_no_evidence_of_what_clipping_did_says_clipping_not_checked(tmp_path):
    sharded_rows(tmp_path, _four_shards(), clips=clip(2.0))
    report = check(tmp_path)
    assert codes(report) == {"GA206"}
    assert "Clipping not checked: no rank reported a norm" in report.verdict
    assert report.worst_severity.value == "warning"


def test_a_missing_rank_with_nothing_found_does_not_read_as_a_pass(tmp_path):
    shards = _four_shards()
    sharded_rows(tmp_path, shards, clips=clip(2.0, reported_norm=1.6))
    report = check(_without(tmp_path, 0))
    assert "Clipping used the true global norm" not in report.verdict
    assert "Clipping not checked" in report.verdict or "GA100" in report.verdict
    shutil.rmtree(tmp_path)


def test_a_verified_coefficient_without_a_norm_to_match_is_not_called_unchecked_clipping(tmp_path):
    shards = _four_shards()
    sharded_rows(tmp_path, shards, clips=clip(2.0), clipped=[s.clone() for s in shards])
    report = check(tmp_path)
    assert "GA206" not in codes(report) and not codes(report)
    assert (
        "Every rank applied the expected coefficient, but which norm clipping used could not be checked"
        in (report.verdict)
    )
