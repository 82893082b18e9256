"""GA503: gradients dumped after clipping are named, never passed."""

from __future__ import annotations

import torch
from builders import check, clip, codes, finding, sharded_rows, tensor_with_norm

from gradaudit.model import ClipCall

MAX_NORM = 1.0
POST_CLIP = MAX_NORM * 3.2 / (3.2 + 1e-6)
"""What clip_grad_norm_ leaves of a gradient of norm 3.2."""


def _halves(total_norm: float) -> list[torch.Tensor]:
    whole = tensor_with_norm(total_norm, (4, 3), dtype=torch.float64)
    return [whole[:2].float(), whole[2:].float()]


def test_gradients_at_max_norm_with_a_larger_recorded_norm_are_named_as_captured_after_clipping(tmp_path):
    sharded_rows(tmp_path, _halves(POST_CLIP), clips=clip(MAX_NORM, reported_norm=3.2))
    report = check(tmp_path)
    assert "GA503" in codes(report)
    hit = finding(report, "GA503")
    assert hit.evidence["reported_norm"] == 3.2
    assert "captured after clipping" in hit.message


def test_gradients_at_max_norm_with_no_recorded_norm_are_named_too(tmp_path):
    sharded_rows(tmp_path, _halves(POST_CLIP), clips=clip(MAX_NORM))
    assert "GA503" in codes(check(tmp_path))


def test_gradients_captured_by_a_recorded_clip_call_are_not_named(tmp_path):
    calls = (ClipCall(reported_norm=POST_CLIP, max_norm=MAX_NORM),)
    sharded_rows(tmp_path, _halves(POST_CLIP), clips=clip(MAX_NORM, reported_norm=POST_CLIP, calls=calls))
    assert "GA503" not in codes(check(tmp_path))


def test_pre_clip_gradients_above_max_norm_are_not_named(tmp_path):
    sharded_rows(tmp_path, _halves(3.2), clips=clip(MAX_NORM, reported_norm=3.2))
    assert "GA503" not in codes(check(tmp_path))
