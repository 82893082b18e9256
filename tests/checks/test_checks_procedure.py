"""GA501, GA502, GA702, GA701: when and on what clipping ran, how losses were averaged, update size."""

import torch
from builders import (
    check,
    clip,
    codes,
    finding,
    not_checked,
    sharded_rows,
    tensor_with_norm,
    whole,
    write_step,
)

from gradaudit.model import ClipCall, ClipRecord, DataRecord


def _grads(n=2):
    return [tensor_with_norm(0.5, (2, 2), seed=r, dtype=torch.float64) for r in range(n)]


def test_clipping_every_microbatch_is_reported_with_the_number_of_calls(tmp_path):
    calls = tuple(ClipCall(reported_norm=0.2 * (i + 1)) for i in range(4))
    sharded_rows(tmp_path, _grads(), clips=ClipRecord(max_norm=1.0, calls=calls))
    found = finding(check(tmp_path), "GA501")
    assert found.evidence["num_calls"] == 4 and found.ranks == (0, 1)
    assert "0.2, 0.4, 0.6, 0.8" in found.message


def test_one_clip_call_per_step_raises_nothing(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=ClipRecord(max_norm=1.0, calls=(ClipCall(reported_norm=0.7),)))
    report = check(tmp_path)
    assert "GA501" not in codes(report) and "GA501" not in not_checked(report)


def test_clipping_before_unscale_is_reported_with_the_effective_threshold(tmp_path):
    record = ClipRecord(max_norm=1.0, loss_scale=1024.0, calls=(ClipCall(unscaled=False, loss_scale=1024.0),))
    sharded_rows(tmp_path, _grads(), clips=record)
    found = finding(check(tmp_path), "GA502")
    assert found.evidence["effective_max_norm"] == 1.0 / 1024
    assert found.ranks == (0, 1)


def test_clipping_after_unscale_raises_no_scale_finding(tmp_path):
    sharded_rows(
        tmp_path, _grads(), clips=ClipRecord(max_norm=1.0, loss_scale=1024.0, unscaled_before_clip=True)
    )
    report = check(tmp_path)
    assert "GA502" not in codes(report) and "GA502" not in not_checked(report)


def test_scale_check_is_not_checked_without_a_loss_scale(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=clip(1.0))
    assert "GA502" in not_checked(check(tmp_path))


def test_ranks_averaging_over_different_token_counts_get_a_warning(tmp_path):
    data = {
        0: DataRecord(tokens=1000, loss_reduction="mean"),
        1: DataRecord(tokens=200, loss_reduction="mean"),
    }
    sharded_rows(tmp_path, _grads(), clips=clip(1.0), data=data)
    found = finding(check(tmp_path), "GA702")
    assert found.severity.value == "warning" and found.ranks == (1,)
    assert found.evidence == {"max_tokens": 1000, "min_tokens": 200}


def test_summed_losses_over_different_token_counts_raise_no_warning(tmp_path):
    data = {0: DataRecord(tokens=1000, loss_reduction="sum"), 1: DataRecord(tokens=200, loss_reduction="sum")}
    sharded_rows(tmp_path, _grads(), clips=clip(1.0), data=data)
    report = check(tmp_path)
    assert "GA702" not in codes(report) and "GA702" not in not_checked(report)


def test_update_norm_is_reported_next_to_the_gradient_norm(tmp_path):
    g = torch.tensor([3.0, 4.0], dtype=torch.float64)
    before = torch.tensor([1.0, 1.0], dtype=torch.float64)
    after = torch.tensor([1.0, 0.9], dtype=torch.float64)
    write_step(
        tmp_path,
        world_size=1,
        params={"w": (2,)},
        pieces={0: [whole("w", grad=g, param_before=before, param_after=after)]},
        clips=clip(1.0),
    )
    found = finding(check(tmp_path), "GA701")
    assert found.severity.value == "info"
    assert (
        abs(found.evidence["update_norm"] - 0.1) < 1e-12
        and abs(found.evidence["gradient_norm"] - 5.0) < 1e-12
    )


def test_update_norm_is_not_checked_without_parameters_before_and_after(tmp_path):
    sharded_rows(tmp_path, _grads(), clips=clip(1.0))
    report = check(tmp_path)
    assert "GA701" in not_checked(report) and "GA701" not in codes(report)
