"""What the guard says of a mistake, on 2 gloo ranks: the cause in the user's words, and where it
happened (the parameter a nonfinite value began in, the lines of the clip calls)."""

from __future__ import annotations

import guard_words_workers as workers
import pytest
from launcher import run_ranks

pytestmark = pytest.mark.integration


def test_a_hand_written_local_clip_the_guard_cannot_see_is_named_by_its_fingerprint_not_its_post_clip_norm(
    tmp_path,
):
    results = run_ranks(workers.train, 2, (str(tmp_path), "fsdp2", "unseen_local_clip"), timeout_s=120)
    assert [codes for _, codes in results[0]["anomalies"]] == [["GA505"]]  # as `gradaudit check` says
    (line,) = [w for w in results[0]["warnings"] if "step 2:" in w]
    assert "fingerprint of a hand-written clip of each rank's own shards" in line
    assert "guard.clip(fn, ...)" in line
    assert "true norm" not in line and "norm at the step 0.141421" in line  # a post-clip norm, said so


def test_a_nonfinite_gradient_is_named_by_the_parameter_and_rank_it_began_in(tmp_path):
    results = run_ranks(workers.train, 2, (str(tmp_path), "fsdp2", "inf_on_rank_1"), timeout_s=120)
    (line,) = [w for w in results[0]["warnings"] if "step 2:" in w]
    assert "GA401" in line
    assert "nonfinite before any clip in fc2.weight (rank 1)" in line
    assert "(rank 0)" not in line.split("nonfinite before any clip in")[1]
    # the dump says it too, and so does `gradaudit check` of it
    from gradaudit.audit import audit_folder
    from gradaudit.checks.base import AuditOptions

    report = audit_folder(tmp_path / "step_2", AuditOptions())
    assert any(
        "nonfinite before the step's first clip call in fc2.weight (rank 1)" in w for w in report.warnings
    )


def test_three_clip_calls_name_their_lines_in_the_training_code(tmp_path):
    results = run_ranks(workers.train, 2, (str(tmp_path), "ddp", "three_clips"), timeout_s=120)
    (line,) = [w for w in results[0]["warnings"] if "step 2:" in w]
    assert "GA501" in line
    sites = line.split("(clip calls at ")[1].split(" on rank 0)")[0].split(", ")
    assert len(sites) == 3 and len(set(sites)) == 1 and sites[0].startswith("guard_words_workers.py:")


def test_a_clip_with_another_max_norm_is_checked_against_it_and_named_once(tmp_path):
    results = run_ranks(workers.train, 2, (str(tmp_path), "ddp", "half_max_norm"), timeout_s=120)
    assert results[0]["anomalies"] == []
    said = [w for w in results[0]["warnings"] if "max_norm" in w]
    assert len(said) == 1 and "passes max_norm 0.05, the guard was told 0.1" in said[0]
