"""The shared gloo launcher: values come back in rank order, failures come back as tracebacks."""

from __future__ import annotations

import time

import launcher_workers
import pytest
from launcher import RankFailure, run_ranks

pytestmark = pytest.mark.integration


def test_every_rank_runs_in_an_initialized_group_and_returns_in_rank_order():
    assert run_ranks(launcher_workers.rank_and_world, 2) == [(0, 2, 2), (1, 2, 2)]


def test_a_raising_rank_fails_with_its_traceback_and_a_hung_rank_is_killed():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(launcher_workers.one_rank_raises, 2, timeout_s=120)
    message = str(failure.value)
    assert "rank 1 raised" in message and "ValueError: boom on rank 1" in message
    assert "rank 0 hung" in message
    assert time.monotonic() - start < 60  # stopped soon after the failure, not at the timeout
