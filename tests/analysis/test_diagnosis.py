"""Measurement by parameter (chunks, subsets, merge) and the diagnosis of which norm was used."""

import math

import numpy as np
import pytest
import torch
from builders import (
    assert_same_measurements,
    box,
    check,
    clip,
    codes,
    flat,
    sharded_rows,
    tensor_with_norm,
    whole,
    write_step,
)

from gradaudit.analysis.coverage import coverage_by_param
from gradaudit.audit import analyse
from gradaudit.dumpfile import TensorReader, load_step
from gradaudit.measure.measure import measure_step
from gradaudit.model import ClipRecord, Topology
from gradaudit.scaleout import merged


def _mixed_step(directory):
    torch.manual_seed(3)
    a = torch.randn(6, 4, dtype=torch.float32)
    b = torch.randn(10, dtype=torch.float32)
    pieces = {
        0: [
            box("a", (0, 0), grad=a[:3].clone(), grad_clipped=a[:3] * 0.5),
            flat("b", 0, grad=b[:4].clone()),
            whole("bias", grad=torch.ones(3), replica_group="dp"),
        ],
        1: [
            box("a", (3, 0), grad=a[3:].clone(), grad_clipped=a[3:] * 0.5),
            flat("b", 4, grad=b[4:].clone()),
            whole("bias", grad=torch.ones(3), replica_group="dp"),
        ],
    }
    write_step(
        directory,
        world_size=2,
        params={"a": (6, 4), "b": (10,), "bias": (3,)},
        pieces=pieces,
        clips=clip(1.0),
    )
    return load_step(directory), a, b


def test_measuring_in_tiny_chunks_gives_the_same_numbers_as_one_chunk(tmp_path):
    step, _, _ = _mixed_step(tmp_path)
    with TensorReader() as reader:
        big = measure_step(step, reader)
        tiny = measure_step(step, reader, chunk_elements=3)
    a, b = big.table, tiny.table
    assert a.size == b.size == 6 and a.has_dots.tolist() == b.has_dots.tolist() == [True, True] + [False] * 4
    assert np.allclose(a.grad.sum_sq, b.grad.sum_sq, rtol=1e-12, atol=0)
    assert np.allclose(a.dot_pre_post, b.dot_pre_post, rtol=1e-12, atol=0)


def test_measurements_of_disjoint_parameter_subsets_merge_into_the_one_pass_result(tmp_path):
    step, _, _ = _mixed_step(tmp_path)
    with TensorReader() as reader:
        whole_pass = measure_step(step, reader)
        first = measure_step(step, reader, params=["a"])
        rest = measure_step(step, reader, params=["bias", "b"])
    assert_same_measurements(merged(rest, first), whole_pass)
    assert_same_measurements(merged(first, rest), whole_pass)
    with pytest.raises(ValueError, match="disjointly"):
        merged(first, first)


def test_progress_is_reported_once_per_parameter(tmp_path):
    step, _, _ = _mixed_step(tmp_path)
    calls = []
    with TensorReader() as reader:
        measure_step(step, reader, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]


def test_replicas_count_once_in_the_true_norm_and_every_copy_in_the_double_counted_one(tmp_path):
    step, a, b = _mixed_step(tmp_path)
    with TensorReader() as reader:
        m = measure_step(step, reader)
    diagnosis = analyse(step, m, coverage=coverage_by_param(step), update_judgements={}).diagnosis
    expected = math.sqrt(float(a.double().square().sum() + b.double().square().sum()) + 3.0)
    assert math.isclose(diagnosis.true_norm, expected, rel_tol=1e-12)
    double = {c.hypothesis.text: c.value for c in diagnosis.ranks[0].candidates}["replicas_double_counted"]
    assert math.isclose(double, math.sqrt(expected**2 + 3.0), rel_tol=1e-12)
    assert math.isclose(
        diagnosis.ranks[0].share_of_squared_norm + diagnosis.ranks[1].share_of_squared_norm, 1.0
    )
    assert (
        diagnosis.ranks[0].applied_coef == pytest.approx(0.5)
        and diagnosis.ranks[0].coef_source == "gradients"
    )


def test_the_inf_norm_is_the_largest_magnitude_and_is_diagnosed_like_any_other(tmp_path):
    grads = [torch.tensor([[0.5, -3.0]]), torch.tensor([[2.0, 1.0]])]
    sharded_rows(tmp_path, grads, clips=ClipRecord(max_norm=1.0, norm_type=math.inf, reported_norm=2.0))
    report = check(tmp_path)
    assert report.global_norm == 3.0 and report.norm_type == math.inf
    assert report.ranks[1].diagnosis == "local_only" and "GA201" in codes(report)


def test_a_group_spanning_the_whole_world_is_not_a_wrong_group(tmp_path):
    grads = [tensor_with_norm(0.6, (2, 2), seed=r, dtype=torch.float64) for r in range(2)]
    true = float(torch.cat(grads).norm())
    sharded_rows(
        tmp_path,
        grads,
        clips=clip(1.0, reported_norm=true),
        topology=Topology(groups={"dp_shard": ((0, 1),)}),
    )
    report = check(tmp_path)
    assert [row.diagnosis for row in report.ranks] == ["correct", "correct"]
    assert "GA203" not in codes(report)


def test_stats_only_dumps_are_diagnosed_from_their_stored_statistics(tmp_path):
    grads = [tensor_with_norm(0.8, (2, 3), seed=r, dtype=torch.float64) for r in range(4)]
    rows = {r: [box("w", (2 * r, 0), grad=g, stats_only=True)] for r, g in enumerate(grads)}
    write_step(
        tmp_path,
        world_size=4,
        params={"w": (8, 3)},
        pieces=rows,
        clips=clip(1.0, reported_norm=0.8, clip_coef=1.0),
    )
    report = check(tmp_path)
    assert abs(report.global_norm - 1.6) < 1e-9
    assert {"GA201", "GA302"} <= codes(report)


def test_stats_taken_for_another_norm_type_leave_the_true_norm_unknown_with_the_reason(tmp_path):
    write_step(
        tmp_path,
        world_size=1,
        params={"w": (3,)},
        pieces={0: [whole("w", grad=torch.ones(3), stats_only=True)]},
        clips=ClipRecord(max_norm=1.0, norm_type=3.0),
        norm_type=1.0,
    )
    report = check(tmp_path)
    assert report.global_norm is None
    assert any("another norm type" in n.reason for n in report.not_checked if n.code == "GA201")


def test_a_rank_that_clipped_every_microbatch_is_not_matched_against_the_norm_hypotheses(tmp_path):
    from gradaudit.model import ClipCall

    grads = [tensor_with_norm(0.8, (2, 3), seed=r, dtype=torch.float64) for r in range(2)]
    calls = (ClipCall(reported_norm=0.3), ClipCall(reported_norm=3.3))
    sharded_rows(tmp_path, grads, clips=ClipRecord(max_norm=1.0, reported_norm=3.3, calls=calls))
    report = check(tmp_path)
    assert "GA501" in codes(report)
    assert codes(report) & {"GA201", "GA204", "GA302"} == set()
    assert report.ranks[0].diagnosis is None and "GA501" in report.ranks[0].diagnosis_detail


def test_a_rank_with_drifted_replicas_is_judged_by_its_own_copies_not_as_a_local_norm(tmp_path):
    base = tensor_with_norm(2.0, (3,), seed=1, dtype=torch.float64)
    drifted = base * 0.5
    pieces = {
        0: [whole("w", grad=base.clone(), replica_group="dp")],
        1: [whole("w", grad=drifted, replica_group="dp")],
    }
    clips = {
        0: clip(1.0, reported_norm=2.0, clip_coef=1 / (2.0 + 1e-6)),
        1: clip(1.0, reported_norm=1.0, clip_coef=1.0),
    }
    write_step(tmp_path, world_size=2, params={"w": (3,)}, pieces=pieces, clips=clips)
    report = check(tmp_path)
    assert {"GA601", "GA301"} <= codes(report)
    assert codes(report) & {"GA201", "GA204", "GA302"} == set()
    assert [row.diagnosis for row in report.ranks] == ["correct", "correct"]
    assert report.verdict.split(". ")[1].startswith("GA601")


def test_scalar_and_empty_parameters_are_measured_and_covered(tmp_path):
    pieces = {
        r: [
            whole("scale", grad=torch.tensor(3.0, dtype=torch.float64), replica_group="dp"),
            whole("empty", grad=torch.zeros(0, 4, dtype=torch.float64)),
        ]
        for r in range(2)
    }
    write_step(
        tmp_path,
        world_size=2,
        params={"scale": (), "empty": (0, 4)},
        pieces=pieces,
        clips=clip(1.0, reported_norm=3.0),
    )
    report = check(tmp_path)
    assert report.global_norm == 3.0
    assert codes(report) & {"GA102", "GA103", "GA201", "GA601"} == set()
