"""GA602-GA603: the sharded step against an unsharded reference step (--reference)."""

import math

import torch
from builders import box, check, clip, codes, flat, not_checked, tensor_with_norm, whole, write_step

from gradaudit.model import ClipRecord

LR = 0.1


def _full_grad():
    return torch.cat([tensor_with_norm(0.8, (2, 3), seed=r) for r in range(4)])  # float32, norm 1.6


def _write_reference(directory, grad, *, max_norm=1.0, before=None, step=1, name="w"):
    coef = min(1.0, max_norm / (float(grad.double().norm()) + 1e-6))
    before = torch.ones_like(grad) if before is None else before
    clipped = grad * coef
    write_step(
        directory,
        world_size=1,
        step=step,
        params={name: tuple(grad.shape)},
        pieces={
            0: [
                whole(
                    name,
                    grad=grad.clone(),
                    grad_clipped=clipped,
                    param_before=before.clone(),
                    param_after=before - LR * clipped,
                )
            ]
        },
        clips=ClipRecord(max_norm=max_norm, reported_norm=float(grad.double().norm()), clip_coef=coef),
    )
    return directory


def _write_sharded(directory, grad, coefs, *, world=4):
    rows = grad.shape[0] // world
    pieces = {}
    for r in range(world):
        g = grad[r * rows : (r + 1) * rows].clone()
        before = torch.ones_like(g)
        pieces[r] = [
            box(
                "w",
                (r * rows, 0),
                grad=g,
                grad_clipped=g * coefs[r],
                param_before=before,
                param_after=before - LR * g * coefs[r],
            )
        ]
    write_step(
        directory,
        world_size=world,
        params={"w": tuple(grad.shape)},
        pieces=pieces,
        clips={r: clip(1.0, clip_coef=coefs[r]) for r in range(world)},
    )
    return directory


def test_local_clipping_matches_the_reference_gradients_but_not_its_clipped_gradients_or_weights(tmp_path):
    grad = _full_grad()
    ref = _write_reference(tmp_path / "ref", grad)
    report = check(_write_sharded(tmp_path / "run", grad, [1.0] * 4), reference=str(ref))
    assert "GA602" not in codes(report) and "GA603" in codes(report)
    messages = [f.message for f in report.findings if f.code == "GA603"]
    assert len(messages) == 2
    assert "clipped gradients differ" in messages[0] and "next weights differ" in messages[1]
    bad = {c.kind for c in report.reference if not c.within_tolerance}
    assert bad == {"grad_clipped", "param_after"}
    assert report.reference[0].within_tolerance is False and report.reference[-1].kind == "grad"
    clipped = next(c for c in report.reference if c.kind == "grad_clipped")
    assert abs(clipped.max_rel_error - 0.375 / 0.625) < 1e-3  # unclipped vs clipped by 0.625


def test_correct_clipping_agrees_with_the_reference(tmp_path):
    grad = _full_grad()
    coef = 1.0 / (float(grad.double().norm()) + 1e-6)
    ref = _write_reference(tmp_path / "ref", grad)
    report = check(_write_sharded(tmp_path / "run", grad, [coef] * 4), reference=str(ref))
    assert {"GA602", "GA603"} & codes(report) == set()
    assert report.reference and all(c.within_tolerance for c in report.reference)
    assert {c.kind for c in report.reference} == {"grad", "grad_clipped", "param_after"}


def test_a_nonfinite_shard_differs_from_the_finite_reference(tmp_path):
    grad = _full_grad()
    ref = _write_reference(tmp_path / "ref", grad)
    broken = grad.clone()
    broken[5, 1] = math.inf
    report = check(_write_sharded(tmp_path / "run", broken, [1.0] * 4), reference=str(ref))
    assert {"GA401", "GA602"} <= codes(report)
    found = [f for f in report.findings if f.code == "GA602"]
    assert any(f.params == ("w",) and "nonfinite" in f.message for f in found)
    assert any("global gradient norm is inf here but 1.6 in the reference" in f.message for f in found)
    differ = {(c.param, c.kind) for c in report.reference if not c.within_tolerance}
    assert {("w", "grad"), ("w", "grad_clipped"), ("w", "param_after")} <= differ
    assert "GA603" in codes(report)


def test_tolerances_follow_the_dtype_and_can_be_overridden(tmp_path):
    grad = _full_grad()
    ref = _write_reference(tmp_path / "ref", grad)
    run = tmp_path / "run"
    pieces = {0: [whole("w", grad=grad * (1 + 1e-3))]}
    write_step(run, world_size=1, params={"w": tuple(grad.shape)}, pieces=pieces, clips=clip(1.0))
    assert "GA602" in codes(check(run, reference=str(ref)))
    relaxed = check(run, reference=str(ref), rtol=1e-2)
    assert "GA602" not in codes(relaxed)
    assert relaxed.reference[0].rtol == 1e-2 and relaxed.command.endswith("--rtol 0.01")


def test_flat_shards_are_compared_with_a_reference_that_is_itself_sharded(tmp_path):
    grad = torch.arange(12, dtype=torch.float64).reshape(3, 4) / 10
    ref = tmp_path / "ref"
    write_step(
        ref,
        world_size=1,
        params={"w": (3, 4)},
        pieces={0: [box("w", (0, 0), grad=grad[:1].clone()), box("w", (1, 0), grad=grad[1:].clone())]},
        clips=clip(1.0),
    )
    run = tmp_path / "run"
    wrong = grad.reshape(-1).clone()
    wrong[7] += 0.5
    write_step(
        run,
        world_size=2,
        params={"w": (3, 4)},
        pieces={0: [flat("w", 0, grad=wrong[:5].clone())], 1: [flat("w", 5, grad=wrong[5:].clone())]},
        clips=clip(1.0),
    )
    report = check(run, reference=str(ref))
    comparison = report.reference[0]
    assert comparison.param == "w" and abs(comparison.max_abs_error - 0.5) < 1e-12
    assert "GA602" in codes(report)


def test_parameters_missing_on_one_side_are_reported(tmp_path):
    grad = _full_grad()
    ref = _write_reference(tmp_path / "ref", grad, name="other")
    report = check(_write_sharded(tmp_path / "run", grad, [1.0] * 4), reference=str(ref))
    found = [f for f in report.findings if f.code == "GA602"]
    assert any(
        "only in the reference" in f.message and "not in the reference dump" in f.message for f in found
    )


def test_reference_checks_are_not_checked_without_a_reference(tmp_path):
    report = check(_write_sharded(tmp_path / "run", _full_grad(), [1.0] * 4))
    assert {"GA602", "GA603"} <= not_checked(report)
    assert report.reference == ()


def test_a_reference_folder_of_steps_is_matched_by_step_number(tmp_path):
    grad = _full_grad()
    _write_reference(tmp_path / "refs" / "step_1", grad, step=1)
    _write_reference(tmp_path / "refs" / "step_2", grad * 2, step=2)
    report = check(_write_sharded(tmp_path / "run", grad, [1.0] * 4), reference=str(tmp_path / "refs"))
    assert "GA602" not in codes(report) and report.reference


def test_a_reference_of_another_step_is_compared_with_a_warning(tmp_path):
    grad = _full_grad()
    ref = _write_reference(tmp_path / "ref", grad, step=9)
    report = check(_write_sharded(tmp_path / "run", grad, [1.0] * 4), reference=str(ref))
    assert any("the reference is step 9" in w for w in report.warnings)
    assert report.reference


def test_a_reference_folder_without_the_step_is_a_usage_error(tmp_path):
    import pytest

    from gradaudit.errors import GradauditError

    _write_reference(tmp_path / "refs" / "step_5", _full_grad(), step=5)
    with pytest.raises(GradauditError, match="no step_1 folder"):
        check(_write_sharded(tmp_path / "run", _full_grad(), [1.0] * 4), reference=str(tmp_path / "refs"))
