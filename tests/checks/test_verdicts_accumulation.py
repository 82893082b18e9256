"""Several clip calls before one step, from hand-made dumps: with per-call statistics the report is of
the moment before the last call; without them (older captures) nothing is derived across moments."""

from __future__ import annotations

import torch
from builders import check, codes, not_checked, whole, write_step

from gradaudit.model import ClipCall, ClipRecord

CALLS = (ClipCall(reported_norm=2.0), ClipCall(reported_norm=5.0))


def _two_replicas(directory, first, last, *, per_call: bool):
    """`w` replicated on 2 ranks: `first` is each rank's gradient before call 1, `last` before call 2."""
    pieces = {
        r: [
            whole(
                "w",
                grad=(last[r] if per_call else first[r]),
                grad_clipped=last[r] * 0.2,
                call_stats=(first[r], last[r]) if per_call else (),
            )
        ]
        for r in range(2)
    }
    write_step(
        directory,
        world_size=2,
        params={"w": (2,)},
        pieces=pieces,
        clips=ClipRecord(max_norm=1.0, reported_norm=5.0, calls=CALLS),
    )


def _unreduced_then_reduced():
    first = [torch.tensor([1.2, 1.6], dtype=torch.float64), torch.tensor([0.6, 0.8], dtype=torch.float64)]
    last = [torch.tensor([3.0, 4.0], dtype=torch.float64)] * 2
    return first, last


def test_without_per_call_statistics_no_replica_or_coefficient_check_is_derived_across_moments(tmp_path):
    _two_replicas(tmp_path, *_unreduced_then_reduced(), per_call=False)
    report = check(tmp_path)
    assert codes(report) == {"GA501"}
    assert {"GA601", "GA301", "GA302"} <= not_checked(report)
    assert "before the first of 2 clip calls" in report.verdict


def test_with_per_call_statistics_the_report_is_of_the_moment_before_the_last_call(tmp_path):
    _two_replicas(tmp_path, *_unreduced_then_reduced(), per_call=True)
    report = check(tmp_path)
    assert codes(report) == {"GA501"}
    assert "True global L2 norm 5 before the last of 2 clip calls" in report.verdict
    ga501 = next(f for f in report.findings if f.code == "GA501")
    assert ga501.evidence["call_1_true_norm"] == 2.0 and ga501.evidence["call_2_true_norm"] == 5.0
    assert "replicas not yet reduced" in ga501.message
    assert {row.diagnosis for row in report.ranks} == {"correct"}
