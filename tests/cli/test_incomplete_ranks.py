"""--allow-incomplete-ranks: an unreadable rank file stops the audit by default,
and with the option becomes a missing rank with its reason while the other ranks are audited."""

from __future__ import annotations

import json
import os

from builders import clip, sharded_rows, tensor_with_norm


def _step_with_a_truncated_rank(tmp_path):
    grads = [tensor_with_norm(0.5, (2, 3), seed=rank) for rank in range(3)]
    step_dir = sharded_rows(tmp_path / "step_1", grads, clips=clip(1.0, reported_norm=0.5, clip_coef=1.0))
    victim = step_dir / "rank_00001.safetensors"
    os.truncate(victim, victim.stat().st_size - 10)
    return step_dir, victim


def test_a_truncated_rank_file_stops_the_audit_by_default(tmp_path, cli):
    step_dir, victim = _step_with_a_truncated_rank(tmp_path)
    code, out, err = cli("check", str(step_dir))
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and victim.name in err and "truncated" in err


def test_with_allow_incomplete_ranks_a_truncated_file_is_a_missing_rank_with_its_reason(tmp_path, cli):
    step_dir, victim = _step_with_a_truncated_rank(tmp_path)
    code, out, err = cli("check", str(step_dir), "--allow-incomplete-ranks", "--format", "json")
    assert code == 1, err
    report = json.loads(out)
    assert report["missing_ranks"] == [[1, 1]]
    assert [row["rank"] for row in report["ranks"]] == [0, 2]
    ga100 = [f for f in report["findings"] if f["code"] == "GA100"]
    assert len(ga100) == 1 and "rank 1's file is unreadable" in ga100[0]["message"]
    assert "truncated" in ga100[0]["message"]
    assert any(victim.name in w and "missing rank" in w for w in report["warnings"])
    assert "--allow-incomplete-ranks" in report["command"]


def test_with_allow_incomplete_ranks_a_folder_of_only_unreadable_files_is_still_refused(tmp_path, cli):
    step_dir, _ = _step_with_a_truncated_rank(tmp_path)
    for name in ("rank_00000.safetensors", "rank_00002.safetensors"):
        (step_dir / name).write_bytes(b"garbage!")
    code, out, err = cli("check", str(step_dir), "--allow-incomplete-ranks")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "none of its 3 rank files can be read" in err
