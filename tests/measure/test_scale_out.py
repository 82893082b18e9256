"""The streaming check (parameters measured by parallel workers) and its scale-out over processes
(torch.distributed, the environment torchrun sets) give exactly the report of the simple path."""

from __future__ import annotations

import functools
import math
import operator
import shutil
from pathlib import Path

import pytest
import torch
from builders import FIXED, assert_same_measurements, box, flat, whole
from scaleout_support import launch, single_process

from gradaudit.audit import Shares, audit_folder
from gradaudit.capture.build import write_rank
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile.loader import load_rank_files
from gradaudit.measure.measure import bytes_to_read, measure_step
from gradaudit.model import ClipRecord, Topology
from gradaudit.render import json as json_renderer
from gradaudit.scaleout import LaunchEnv, launch_env, share_of

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "sample_dumps"


def _write_dense_step(directory: Path) -> None:
    """4 ranks: fp32 and bf16 parameters in FSDP1-style flat shards spanning several read chunks,
    a replicated bias (compared by value), clipped gradients, and a nan and an inf on rank 2."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(700, 1000, generator=gen) * 1e-3
    e = (torch.randn(300, 999, generator=gen) * 1e-2).to(torch.bfloat16)
    bias = torch.randn(1000, generator=gen)
    w.view(-1)[123_457] = math.nan
    w.view(-1)[400_001] = math.inf
    cuts_w = [0, 170_001, 350_000, 520_000, w.numel()]
    cuts_e = [0, 100_000, 150_000, 299_700, e.numel()]
    coef = 0.5
    for rank in range(4):
        pieces = [
            flat(
                "w",
                cuts_w[rank],
                grad=w.view(-1)[cuts_w[rank] : cuts_w[rank + 1]],
                grad_clipped=w.view(-1)[cuts_w[rank] : cuts_w[rank + 1]] * coef,
            ),
            flat("e", cuts_e[rank], grad=e.view(-1)[cuts_e[rank] : cuts_e[rank + 1]]),
            whole("b", grad=bias + (1e-3 if rank == 3 else 0.0), replica_group="dp"),
        ]
        write_rank(
            directory,
            rank=rank,
            world_size=4,
            step=1,
            params={"w": (700, 1000), "e": (300, 999), "b": (1000,)},
            pieces=pieces,
            clip=ClipRecord(max_norm=1.0, reported_norm=2.5, clip_coef=coef),
            topology=Topology(groups={"dp": ((0, 1, 2, 3),)}),
            **FIXED,
        )


def _write_stats_step(directory: Path) -> None:
    """3 ranks of a stats-only dump: row shards of one parameter, a replicated one compared by fingerprint."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(30, 40, generator=gen)
    norm = torch.randn(40, generator=gen)
    for rank in range(3):
        write_rank(
            directory,
            rank=rank,
            world_size=3,
            step=1,
            params={"w": (30, 40), "norm": (40,)},
            pieces=[
                box("w", (10 * rank, 0), grad=w[10 * rank : 10 * rank + 10], stats_only=True),
                whole("norm", grad=norm, replica_group="dp", stats_only=True),
            ],
            clip=ClipRecord(max_norm=1.0, reported_norm=float(w.norm()), clip_coef=1.0),
            topology=Topology(groups={"dp": ((0, 1, 2),)}),
            **FIXED,
        )


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> Path:
    """A folder of step_<N> folders: every shipped sample dump, a dense dump and a stats-only dump."""
    parent = tmp_path_factory.mktemp("steps")
    samples = sorted(p for p in SAMPLES.iterdir() if (p / "step_1").is_dir())
    assert samples, f"no sample dumps under {SAMPLES}"
    for number, sample in enumerate(samples, start=1):
        shutil.copytree(sample / "step_1", parent / f"step_{number}")
    _write_dense_step(parent / "step_100")
    _write_stats_step(parent / "step_101")
    return parent


def _json_of(directory: Path, measure) -> str:
    shares = Shares(load_files=load_rank_files, measure=measure)
    result = audit_folder(directory, AuditOptions(), shares=shares)
    return (
        json_renderer.render_multi(result)
        if hasattr(result, "summary")
        else json_renderer.render_report(result)
    )


def test_parallel_workers_give_the_report_of_one_worker_byte_for_byte(steps):
    simple = _json_of(steps, functools.partial(measure_step, workers=1))
    for workers in (2, 5):
        assert _json_of(steps, functools.partial(measure_step, workers=workers)) == simple
    assert '"GA401"' in simple and '"GA601"' in simple


def test_parameters_measured_in_two_shares_merge_into_the_one_pass_result(steps):
    from gradaudit.dumpfile import TensorReader, load_step
    from gradaudit.scaleout import merged

    step = load_step(steps / "step_100")
    with TensorReader(step) as reader:
        whole_pass = measure_step(step, reader, workers=2)
        shares = [
            measure_step(step, reader, params=share_of(bytes_to_read(step), rank, 2), workers=1)
            for rank in (0, 1)
        ]
    assert all(share.params for share in shares)
    assert_same_measurements(merged(shares[0], shares[1]), whole_pass)


def test_shares_split_every_parameter_exactly_once_and_balance_bytes():
    costs = {f"p{i}": (i * 7919) % 1000 + 1 for i in range(50)}
    shares = [share_of(costs, rank, 3) for rank in range(3)]
    assert sorted(functools.reduce(operator.iadd, shares, [])) == sorted(costs)
    loads = [sum(costs[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(costs.values())


def test_the_torchrun_environment_is_recognised_and_one_process_is_not_a_scale_out():
    assert launch_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}) == LaunchEnv(
        rank=1, world_size=4, local_world_size=2
    )
    assert launch_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert launch_env({}) is None


@pytest.mark.integration
def test_two_processes_under_the_torchrun_environment_print_the_single_process_report(steps):
    args = ["check", str(steps), "--format", "json"]
    single = single_process(args)
    rank0, rank1 = launch(args)
    assert single.returncode == 1, single.stderr.decode()
    assert (rank0.returncode, rank1.returncode) == (single.returncode, single.returncode), (
        rank0.stderr.decode() + rank1.stderr.decode()
    )
    assert rank0.stdout == single.stdout
    assert rank1.stdout == b""


@pytest.mark.integration
def test_a_user_error_stops_every_process_with_exit_2(tmp_path):
    (tmp_path / "rank_00000.safetensors").write_bytes(b"not a dump")
    for result in launch(["check", str(tmp_path), "--format", "json"]):
        assert result.returncode == 2, result.stderr.decode()
        assert result.stdout == b""
