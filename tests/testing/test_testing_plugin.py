"""gradaudit.testing as a user's test suite meets it: test files run by pytest in a fresh process
(pytester), the plugin loaded, ranks spawned on CPU gloo."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

PARITY_TESTS = '''
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gradaudit.testing import check_clip_parity


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def parallelize(model, mesh):
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def make_batch(rank, step):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=generator), 3 * torch.randn(4, 4, generator=generator)


def step(model, batch, max_norm):
    inputs, targets = batch
    F.mse_loss(model(inputs), targets).backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def clip_by_local_norm(parameters, max_norm):
    """The mistake: the norm of this rank's shards, never reduced across ranks."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for grad in grads:
        grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def step_with_local_clip(model, batch, max_norm):
    inputs, targets = batch
    F.mse_loss(model(inputs), targets).backward()
    return clip_by_local_norm(list(model.parameters()), max_norm)


def test_fsdp2_with_torch_clip_matches_the_reference():
    reports = check_clip_parity(build=build, parallelize=parallelize, make_batch=make_batch, step=step, world_size=2)
    assert [r.step for r in reports] == [1, 2]


def test_local_norm_clip_helper():
    check_clip_parity(
        build=build, parallelize=parallelize, make_batch=make_batch, step=step_with_local_clip,
        clip=clip_by_local_norm, world_size=4,
    )


def test_vacuous_max_norm():
    check_clip_parity(build=build, parallelize=parallelize, make_batch=make_batch, step=step, world_size=2, max_norm=100.0)


def test_a_lambda_cannot_reach_the_ranks():
    check_clip_parity(build=lambda: build(), parallelize=parallelize, make_batch=make_batch, step=step, world_size=2)
'''

MARKER_TESTS = """
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.gradaudit_distributed(world_size=4, mesh={"dp": 2, "tp": 2})
def test_the_body_runs_on_every_rank_in_one_group(gradaudit_rank, tmp_path):
    import torch  # here: the test process itself never imports torch, only its ranks do
    import torch.distributed as dist

    value = torch.tensor([float(gradaudit_rank.rank + 1)])
    dist.all_reduce(value)
    assert value.item() == 10.0
    assert gradaudit_rank.mesh.mesh_dim_names == ("dp", "tp")
    (HERE / f"ran_on_rank_{gradaudit_rank.rank}").write_text(str(tmp_path))


@pytest.mark.gradaudit_distributed(world_size=2)
def test_two_ranks_crash(gradaudit_rank):
    if gradaudit_rank.rank == 1:
        raise ValueError("boom on rank 1")
    assert [gradaudit_rank.rank] == [7]


@pytest.mark.gradaudit_distributed(world_size=2)
def test_rank_one_skips(gradaudit_rank):
    if gradaudit_rank.rank == 1:
        pytest.skip("rank 1 lacks the feature")


@pytest.mark.gradaudit_distributed(world_size=2, timeout=2)
def test_rank_one_hangs(gradaudit_rank):
    if gradaudit_rank.rank == 1:
        time.sleep(60)


def test_the_fixture_without_the_marker(gradaudit_rank):
    pass


@pytest.mark.gradaudit_distributed(world_size=2)
def test_a_fixture_that_cannot_reach_the_ranks(gradaudit_rank, capsys):
    pass
"""


def run_user_suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, source: str):
    """The test file run as a user's suite: a fresh pytest process with only gradaudit's plugin (this tree's)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    # An installed gradaudit registers the plugin itself; load exactly this tree's, once.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makepyfile(test_user_suite=textwrap.dedent(source))
    return pytester.runpytest_subprocess(
        "-p", "gradaudit.testing.plugin", "-p", "no:cacheprovider", "-rs", "-q"
    )


def section(output: str, test_name: str) -> str:
    """The failure report of one test in pytest's output (from its ____ header to the next)."""
    start = output.index(f" {test_name} _")
    following = output.find("\n____", start)
    return output[start : following if following != -1 else len(output)]


def test_check_clip_parity_passes_a_correct_fsdp2_step_and_fails_a_local_clip_and_a_vacuous_setup(
    pytester, monkeypatch
):
    result = run_user_suite(pytester, monkeypatch, PARITY_TESTS)
    output = result.stdout.str()
    result.assert_outcomes(passed=1, failed=3)

    local = section(output, "test_local_norm_clip_helper")
    assert (
        "ParityFailure: gradaudit: the sharded step on 4 ranks does not clip like the unsharded reference"
        in local
    )
    assert "GA201: clipping used a local norm on ranks 0-3" in local
    assert "GA302 error" in local and "GA603 error" in local
    assert "reported norm" in local and "(local_only)" in local
    assert "reproduce: gradaudit check " in local

    vacuous = section(output, "test_vacuous_max_norm")
    assert "clipping is vacuous: the unsharded reference's pre-clip norm is" in vacuous
    assert "not above max_norm 100" in vacuous
    assert "GA" not in vacuous.split("clipping is vacuous")[1].split("\n")[0]

    unsendable = section(output, "test_a_lambda_cannot_reach_the_ranks")
    assert (
        "NotSendableError: check_clip_parity: build='test_a_lambda_cannot_reach_the_ranks.<locals>.<lambda>'"
        in unsendable
    )
    assert "define it at module level in the test file" in unsendable


def test_a_marked_test_runs_on_every_rank_fails_once_with_each_crashed_rank_and_skips_when_a_rank_skips(
    pytester, monkeypatch
):
    result = run_user_suite(pytester, monkeypatch, MARKER_TESTS)
    output = result.stdout.str()
    result.assert_outcomes(passed=1, failed=3, skipped=1, errors=1)
    assert sorted(p.name for p in pytester.path.glob("ran_on_rank_*")) == [
        f"ran_on_rank_{r}" for r in range(4)
    ]

    crash = section(output, "test_two_ranks_crash")
    assert crash.count("2 of 2 ranks failed (ranks 0, 1)") == 1
    assert "--- rank 1 raised:" in crash and "ValueError: boom on rank 1" in crash
    # The rank's assertion is rewritten as pytest rewrites it in-process: its values are shown.
    assert "--- rank 0 raised:" in crash and "AssertionError: assert [0] == [7]" in crash
    assert "gradaudit/localranks.py" not in crash  # the launcher's own frames are left out

    assert "SKIPPED [1]" in output and "rank 1: rank 1 lacks the feature" in output
    hang = section(output, "test_rank_one_hangs")
    assert "rank 1 hung and was killed: still running after the timeout of 2 s" in hang
    assert (
        "the gradaudit_rank fixture needs the test marked @pytest.mark.gradaudit_distributed(...)" in output
    )
    unsendable = section(output, "test_a_fixture_that_cannot_reach_the_ranks")
    assert (
        "the value of fixture 'capsys' of test_user_suite.py::test_a_fixture_that_cannot_reach_the_ranks"
        in unsendable
    )
    assert "use them inside the body instead" in unsendable and "Traceback" not in unsendable
