"""A local-norm FSDP2 run on 4 real gloo ranks with one rank file missing: the present ranks prove a
lower bound on the global norm, and that bound still names the local-only norm."""

from __future__ import annotations

import pytest
import verdict_workers
from launcher import run_ranks

from gradaudit.audit import audit_step_dir
from gradaudit.checks.base import AuditOptions

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def local_clip_step(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("missing_rank")
    (step_dir, *_) = run_ranks(verdict_workers.fsdp2_local_clip, 4, (str(out_root),), timeout_s=180)
    return step_dir


def test_a_local_norm_run_with_a_missing_rank_is_still_diagnosed_as_local_only_by_the_bound(local_clip_step):
    import pathlib
    import shutil

    folder = pathlib.Path(local_clip_step)
    partial = folder.parent / "partial" / folder.name
    partial.mkdir(parents=True)
    for path in folder.iterdir():
        if path.name != "rank_00002.safetensors":
            shutil.copy(path, partial / path.name)
    full = audit_step_dir(folder, AuditOptions())
    report = audit_step_dir(partial, AuditOptions())
    codes = {f.code for f in report.findings}
    assert {"GA100", "GA201", "GA302"} <= codes, [(f.code, f.message) for f in report.findings]
    assert "GA204" not in codes
    (ga201,) = [f for f in report.findings if f.code == "GA201"]
    assert ga201.ranks == (0, 1, 3)
    assert "rank 2 is missing" in ga201.message and "at least" in ga201.message
    bound = ga201.evidence["true_norm_lower_bound"]
    assert bound < full.global_norm
    assert all(row.reported_norm < bound for row in report.ranks)
    assert report.global_norm is None
    assert "at least" in report.verdict and "rank 2 is missing" in report.verdict
    assert {row.diagnosis for row in report.ranks} == {"local_only"}
