"""GA601: copies of one piece on several ranks must agree."""

import torch
from builders import check, clip, codes, finding, not_checked, whole, write_step


def _replicas(tmp_path, copies, *, stats_only=False, dtype=torch.float32):
    write_step(
        tmp_path,
        world_size=len(copies),
        params={"w": tuple(copies[0].shape)},
        pieces={
            r: [whole("w", grad=g.to(dtype), replica_group="dp", stats_only=stats_only)]
            for r, g in enumerate(copies)
        },
        clips=clip(1.0),
    )
    return check(tmp_path)


def _base():
    return torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)


def test_a_replica_that_drifted_is_named_with_how_far(tmp_path):
    drifted = _base().clone()
    drifted[1, 1] += 0.3
    report = _replicas(tmp_path, [_base(), _base().clone(), drifted])
    found = finding(report, "GA601")
    assert found.ranks == (2,) and found.params == ("w",)
    assert abs(found.evidence["worst_difference"] - 0.3) < 1e-6
    assert found.evidence["compared_by"] == "values"


def test_identical_replicas_raise_nothing(tmp_path):
    report = _replicas(tmp_path, [_base(), _base().clone()])
    assert "GA601" not in codes(report) and "GA601" not in not_checked(report)


def test_replicas_that_differ_only_by_bfloat16_rounding_noise_agree(tmp_path):
    noisy = _base() * (1 + 1e-3)
    assert "GA601" not in codes(_replicas(tmp_path, [_base(), noisy], dtype=torch.bfloat16))


def test_stats_only_replicas_are_compared_by_fingerprint(tmp_path):
    drifted = _base().clone()
    drifted[0, 0], drifted[0, 1] = drifted[0, 1], drifted[0, 0]  # same norm, different values
    found = finding(_replicas(tmp_path / "a", [_base(), drifted], stats_only=True), "GA601")
    assert found.evidence["compared_by"] == "fingerprint"
    assert "GA601" not in codes(_replicas(tmp_path / "b", [_base(), _base().clone()], stats_only=True))


def test_a_nan_in_one_replica_only_is_a_difference(tmp_path):
    broken = _base().clone()
    broken[2, 3] = float("nan")
    assert finding(_replicas(tmp_path, [_base(), broken]), "GA601").ranks == (1,)
