"""The guard's norm pass lent to torch's clip_grad_norm_ (live/lending.py): one pass over the gradients
per checked step instead of two, the clip's numbers bit for bit what they are without the guard, and
nothing lent that the clip would have computed differently."""

from __future__ import annotations

import pytest
import torch

import gradaudit
from gradaudit.live.lending import NormPass, lent

MAX_NORM = 1e-3


def _run(tmp_path, *, guarded, steps=6, clip=None, dtype=torch.float32):
    """Per step the clip's returned norm, the passes `torch._foreach_norm` made over the model's
    gradients, the weights at the end, and the lengths of the tensors `torch.stack` stacked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clip = clip or (lambda m, _: torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM))
    real, passes = torch._foreach_norm, []
    real_stack, stacks = torch.stack, []

    def counted(tensors, *args, **kwargs):
        passes.append(len(tensors))
        return real(tensors, *args, **kwargs)

    def counted_stack(tensors, *args, **kwargs):
        stacks.append(len(tensors))
        return real_stack(tensors, *args, **kwargs)

    norms = []
    torch._foreach_norm, torch.stack = counted, counted_stack
    try:
        guard = (
            gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) if guarded else None
        )
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(len(norms))).to(dtype)).pow(
                2
            ).sum().backward()
            norms.append(clip(model, guard))
            opt.step()
        if guard is not None:
            assert guard.anomalies == []
            guard.remove()
    finally:
        torch._foreach_norm, torch.stack = real, real_stack
    return norms, passes, [p.detach().clone() for p in model.parameters()], stacks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_clip_takes_the_guards_pass_and_returns_the_same_bits(tmp_path, dtype):
    norms, passes, weights, _ = _run(tmp_path / "none", guarded=False, dtype=dtype)
    guarded_norms, guarded_passes, guarded_weights, guarded_stacks = _run(
        tmp_path / "guard", guarded=True, dtype=dtype
    )
    assert passes == [8] * 6
    assert guarded_passes == [8] * 6  # the guard's own; the clip took them instead of a second pass
    assert guarded_stacks == [8] * 6  # the guard's stack of the norms; the clip took their total from it
    assert [n.item() for n in guarded_norms] == [n.item() for n in norms]
    assert all(torch.equal(a, b) for a, b in zip(weights, guarded_weights, strict=True))
    assert torch._foreach_norm is not None and torch._foreach_norm.__name__ == "_foreach_norm"


def test_a_users_clip_around_torchs_is_measured_and_lent_where_torchs_is_called(tmp_path):
    """A clip function of the user's that scales the gradients in place before calling torch's: the
    guard measures at torch's call, and the clip's norm is of what it is given, as without the guard."""

    def halving_clip(model, _):
        for p in model.parameters():
            p.grad.mul_(0.5)
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)

    norms, _, weights, _ = _run(tmp_path / "none", guarded=False, clip=halving_clip)
    guarded_norms, guarded_passes, guarded_weights, guarded_stacks = _run(
        tmp_path / "guard", guarded=True, clip=halving_clip
    )
    assert [n.item() for n in guarded_norms] == [n.item() for n in norms]
    assert all(torch.equal(a, b) for a, b in zip(weights, guarded_weights, strict=True))
    assert guarded_passes == [8] * 6 and guarded_stacks == [8] * 6


def test_a_clip_that_unscales_inside_the_call_is_not_lent_to(tmp_path):
    """GradScaler's unscale kernel writes the gradients without moving their version counters: a call
    that unscales them before torch's clip (Accelerate's, DeepSpeed's, `guard.clip_unscaling`) must not
    get the norms of the scaled gradients. Only torch's own clip call, which writes nothing before its
    norm, is lent to."""

    def unscale(model):
        grads = [p.grad for p in model.parameters()]
        versions = [g._version for g in grads]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), torch.full((1,), 0.5))
        assert [g._version for g in grads] == versions  # why a version check could not tell
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)

    def unscaling_clip(model, guard):
        return guard.clip_unscaling(2.0, unscale, model) if guard is not None else unscale(model)

    norms, passes, weights, _ = _run(tmp_path / "none", guarded=False, clip=unscaling_clip)
    guarded_norms, guarded_passes, guarded_weights, guarded_stacks = _run(
        tmp_path / "guard", guarded=True, clip=unscaling_clip
    )
    assert [n.item() for n in guarded_norms] == [n.item() for n in norms]
    assert all(torch.equal(a, b) for a, b in zip(weights, guarded_weights, strict=True))
    assert passes == [8] * 6 and guarded_passes == [8] * 12  # the guard's, and the clip's own
    assert guarded_stacks == [8] * 12


def test_a_pass_is_lent_only_to_the_same_tensors_in_the_same_order():
    grads = [torch.randn(3, 3) for _ in range(4)]
    done = NormPass(grads, 2.0, torch._foreach_norm(grads, 2.0))
    assert done.answers((list(grads), 2.0), {})
    assert not done.answers((grads[::-1], 2.0), {})  # another order
    assert not done.answers((grads[:3], 2.0), {})  # a part
    assert not done.answers(([g.clone() for g in grads], 2.0), {})  # equal numbers, other tensors
    assert not done.answers((grads, 1.0), {})  # another order of norm
    assert not done.answers((grads, 2.0), {"dtype": torch.float64})  # asked in another dtype


def test_the_lent_pass_answers_inside_the_block_only_and_other_calls_go_through():
    grads = [torch.randn(5) for _ in range(3)]
    done = NormPass(grads, 2.0, torch._foreach_norm(grads, 2.0))
    real = torch._foreach_norm
    with lent(done):
        assert torch._foreach_norm is not real
        again = torch._foreach_norm(grads, 2.0)
        other = torch._foreach_norm([torch.ones(4)], 2.0)
        assert all(a is b for a, b in zip(again, done.norms, strict=True))
        assert other[0].item() == 2.0
    assert torch._foreach_norm is real
    total = torch.nn.utils.clip_grad._get_total_norm
    with pytest.raises(ValueError), lent(done):
        assert torch.nn.utils.clip_grad._get_total_norm is not total
        raise ValueError("the clip failed")
    assert torch._foreach_norm is real  # restored when the call raises
    assert torch.nn.utils.clip_grad._get_total_norm is total


def test_the_pass_is_not_held_past_the_clip_call(tmp_path):
    """The guard keeps no reference to the step's gradients after the clip (zero_grad frees them)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradaudit.guard(model, max_norm=MAX_NORM, optimizer=opt, out_dir=tmp_path) as guard:
        model(torch.randn(4, 8)).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        assert guard._summary.lendable is None
        opt.step()


@pytest.mark.parametrize(
    ("options", "total_lent"),
    [({}, True), ({"foreach": False}, False), ({"error_if_nonfinite": True}, False)],
)
def test_the_total_is_lent_only_where_torch_would_stack_the_same_norms(tmp_path, options, total_lent):
    """foreach=False takes the norms one by one, error_if_nonfinite checks the total: torch's own
    computes those; either way the clip's numbers are the same bits as without the guard."""

    def clip(model, _):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, **options)

    norms, _, weights, _ = _run(tmp_path / "none", guarded=False, clip=clip)
    guarded_norms, _, guarded_weights, guarded_stacks = _run(tmp_path / "guard", guarded=True, clip=clip)
    assert [n.item() for n in guarded_norms] == [n.item() for n in norms]
    assert all(torch.equal(a, b) for a, b in zip(weights, guarded_weights, strict=True))
    assert guarded_stacks == [8] * (6 if total_lent else 12)


def test_the_total_answers_only_one_dtype_of_plain_tensors_asked_as_torchs_clip_asks():
    grads = [torch.randn(3, 3) for _ in range(4)]
    norms = torch._foreach_norm(grads, 2.0)
    done = NormPass(grads, 2.0, norms, torch.stack(norms))
    assert done.answers_total((list(grads), 2.0, False, None), {})
    assert done.answers_total((list(grads),), {"norm_type": 2, "foreach": True})
    assert not done.answers_total((grads[::-1], 2.0, False, None), {})  # another order
    assert not done.answers_total((tuple(grads), 2.0, False, None), {})  # not the list the clip makes
    assert not done.answers_total((list(grads), float("inf"), False, None), {})
    assert not done.answers_total((list(grads), 2.0, True, None), {})  # error_if_nonfinite
    assert not done.answers_total((list(grads), 2.0, False, False), {})  # foreach=False
    assert not done.answers_total((list(grads), 2.0), {"dtype": torch.float64})  # not torch's argument
    assert not NormPass(grads, 2.0, norms).answers_total((list(grads),), {})  # nothing stacked
    mixed = [*grads[:3], grads[3].to(torch.float16)]
    assert not NormPass(mixed, 2.0, norms, done.stacked).answers_total((list(mixed),), {})
    params = [torch.nn.Parameter(g) for g in grads]
    assert not NormPass(params, 2.0, norms, done.stacked).answers_total((list(params),), {})
