"""audit_step and dump in one process (world size 1): what is recorded, when, and that nothing stays hooked."""

from __future__ import annotations

import math

import pytest
import torch
from capture_support import MAX_NORM, make_model, single_process  # noqa: F401 - autouse fixture

import gradaudit
from gradaudit.audit import audit_step_dir
from gradaudit.capture.names import logical_name
from gradaudit.checks.base import AuditOptions
from gradaudit.dumpfile import TensorReader, load_step


def backward(model, scale: float = 1.0):
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    (model(x).pow(2).mean() * scale).backward()


def read(step, rank, param, kind):
    dump = step.ranks[rank]
    (piece,) = [p for p in dump.pieces if p.param == param]
    with TensorReader() as reader:
        return reader.read(dump.path, piece.tensors[kind])


def test_one_step_records_grads_around_clip_and_params_around_the_optimizer_step(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradaudit.audit_step(model, tmp_path, step=7, max_norm=MAX_NORM, optimizer=opt) as audit:
        backward(model)
        before = {n: p.grad.clone() for n, p in model.named_parameters()}
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        norm = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        opt.step()
        audit.record(loss=0.25, tokens=6, loss_reduction="mean")
    step = load_step(tmp_path / "step_7")
    assert step.world_size == 1 and step.ranks_present == (0,)
    clip = step.clip
    assert clip.max_norm == MAX_NORM and clip.reported_norm == pytest.approx(float(norm))
    assert len(clip.calls) == 1 and clip.calls[0].max_norm == MAX_NORM and clip.calls[0].norm_type == 2.0
    assert clip.step_skipped is False
    coef = MAX_NORM / (float(norm) + 1e-6)
    for name, p in model.named_parameters():
        assert torch.equal(read(step, 0, name, "grad"), before[name])
        assert torch.allclose(read(step, 0, name, "grad_clipped"), before[name] * coef)
        assert torch.equal(read(step, 0, name, "param_before"), weights[name])
        assert torch.equal(read(step, 0, name, "param_after"), p.detach())
    assert step.ranks[0].data.tokens == 6 and step.ranks[0].data.loss_reduction == "mean"
    pieces = step.ranks[0].pieces
    assert all(p.replica_group is None for p in pieces)


def test_no_hook_stays_registered_after_the_context_even_when_the_step_raises(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradaudit.audit_step(model, tmp_path, step=1, max_norm=MAX_NORM, optimizer=opt):
        assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    with pytest.raises(ZeroDivisionError):
        with gradaudit.audit_step(model, tmp_path, step=2, max_norm=MAX_NORM, optimizer=opt):
            raise ZeroDivisionError
    assert len(opt._optimizer_step_pre_hooks) == 0 and len(opt._optimizer_step_post_hooks) == 0
    assert not (tmp_path / "step_2").exists()  # a step that raised leaves no half-recorded dump


def test_each_clip_call_is_recorded_and_post_clip_grads_are_those_after_the_last(tmp_path):
    model = make_model()
    with gradaudit.audit_step(model, tmp_path, step=3, max_norm=MAX_NORM) as audit:
        backward(model)
        first = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        second = audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), max_norm=MAX_NORM / 2)
    step = load_step(tmp_path / "step_3")
    calls = step.clip.calls
    assert [c.reported_norm for c in calls] == [pytest.approx(float(first)), pytest.approx(float(second))]
    assert [c.max_norm for c in calls] == [MAX_NORM, MAX_NORM / 2]
    clipped = [read(step, 0, n, "grad_clipped") for n, _ in model.named_parameters()]
    assert math.sqrt(sum(float(c.pow(2).sum()) for c in clipped)) == pytest.approx(MAX_NORM / 2, rel=1e-4)


def test_clip_returns_exactly_what_the_clipping_function_returns(tmp_path):
    model = make_model()
    sentinel = object()
    with gradaudit.audit_step(model, tmp_path, step=4, max_norm=MAX_NORM) as audit:
        backward(model)
        assert audit.clip(lambda: sentinel) is sentinel
    assert load_step(tmp_path / "step_4").clip.calls[0].reported_norm is None


def test_grad_scaler_state_is_recorded_per_clip_call_and_found_inf_after_update(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with gradaudit.audit_step(
        model, tmp_path, step=5, max_norm=MAX_NORM, optimizer=opt, scaler=scaler
    ) as audit:
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)  # before unscale_: GA502
        scaler.unscale_(opt)
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
    clip = load_step(tmp_path / "step_5").clip
    assert [c.unscaled for c in clip.calls] == [False, True]
    assert clip.unscaled_before_clip is False
    assert clip.loss_scale == 1024.0 and clip.calls[0].loss_scale == 1024.0
    assert clip.found_inf is False and clip.step_skipped is False


def test_grad_scaler_reports_a_skipped_step_when_gradients_overflow(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with gradaudit.audit_step(
        model, tmp_path, step=6, max_norm=MAX_NORM, optimizer=opt, scaler=scaler
    ) as audit:
        scaler.scale(model(torch.randn(3, 4)).pow(2).mean()).backward()
        model[0].weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
    clip = load_step(tmp_path / "step_6").clip
    assert clip.found_inf is True and clip.step_skipped is True


def _hand_clip(params, max_norm: float) -> torch.Tensor:
    """A clip no interception knows: the training code's own norm and scaling."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    for g in grads:
        g.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def test_clipping_outside_audit_clip_is_seen_through_the_optimizer_hook(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with gradaudit.audit_step(model, tmp_path, step=8, max_norm=MAX_NORM, optimizer=opt) as audit:
        backward(model)
        norm = _hand_clip(list(model.parameters()), MAX_NORM)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        audit.record(reported_norm=norm, clip_coef=MAX_NORM / (float(norm) + 1e-6))
    step = load_step(tmp_path / "step_8")
    assert step.clip.reported_norm == pytest.approx(float(norm)) and step.clip.calls == ()
    assert step.clip.clip_coef == pytest.approx(MAX_NORM / (float(norm) + 1e-6))
    for name, grad in grads.items():  # the gradients the step used, the only ones the audit saw
        assert torch.equal(read(step, 0, name, "grad_clipped"), grad)
        assert torch.equal(read(step, 0, name, "grad"), grad)
    assert "GA503" in {f.code for f in audit_step_dir(tmp_path / "step_8", AuditOptions()).findings}


@pytest.mark.parametrize("api", ["clip_grad_norm_", "split", "imported_by_name"])
def test_a_torch_clip_made_without_audit_clip_is_recorded_and_left_as_it_was(tmp_path, api):
    from torch.nn.utils.clip_grad import clip_grad_norm_ as imported_before_the_audit

    def clip(params):
        if api == "split":
            total = torch.nn.utils.get_total_norm([p.grad for p in params])
            torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
            return total
        fn = imported_before_the_audit if api == "imported_by_name" else torch.nn.utils.clip_grad_norm_
        return fn(params, MAX_NORM)

    without = make_model()
    backward(without)
    expected_norm = clip(list(without.parameters()))
    model = make_model()
    with gradaudit.audit_step(model, tmp_path, step=8, max_norm=MAX_NORM):
        backward(model)
        norm = clip(list(model.parameters()))
    assert torch.equal(norm, expected_norm)  # the clip's result and gradients are its own
    for p, q in zip(model.parameters(), without.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    step = load_step(tmp_path / "step_8")
    [call] = step.clip.calls
    assert call.reported_norm == pytest.approx(float(norm)) and call.max_norm == MAX_NORM
    assert torch.nn.utils.clip_grad_norm_.__module__ == "torch.nn.utils.clip_grad"  # restored
    assert not hasattr(torch.nn.utils.clip_grad_norm_, "__gradaudit_intercepted__")


def test_dump_writes_current_gradients_and_metadata_in_one_call(tmp_path):
    model = make_model()
    backward(model)
    path = gradaudit.dump(model, tmp_path, step=9, max_norm=MAX_NORM, reported_norm=1.5, tokens=6, loss=0.5)
    assert path == tmp_path / "step_9" / "rank_00000.safetensors"
    step = load_step(tmp_path / "step_9")
    assert step.clip.reported_norm == 1.5 and step.ranks[0].data.loss == 0.5
    assert torch.equal(read(step, 0, "0.weight", "grad"), model[0].weight.grad)


def test_stats_mode_writes_float64_summaries_and_no_values_except_chosen_params(tmp_path):
    model = make_model()
    backward(model)
    gradaudit.dump(model, tmp_path, step=10, max_norm=MAX_NORM, mode="stats", full_params=["1.*"])
    dump = load_step(tmp_path / "step_10").ranks[0]
    assert dump.mode == "stats"
    by_name = {p.param: p for p in dump.pieces}
    weight = by_name["0.weight"]
    assert weight.tensors == {} and set(weight.stats) == {"grad"}
    assert weight.stats["grad"].sum_sq == pytest.approx(float(model[0].weight.grad.double().pow(2).sum()))
    assert weight.stats["grad"].numel == 12
    assert set(by_name["1.weight"].tensors) == {"grad"} and set(by_name["1.weight"].stats) == {"grad"}
    full_mode = make_model()
    backward(full_mode)
    gradaudit.dump(full_mode, tmp_path, step=11, max_norm=MAX_NORM)
    assert all(
        p.stats == {} and set(p.tensors) == {"grad"} for p in load_step(tmp_path / "step_11").ranks[0].pieces
    )


def test_activation_checkpoint_wrappers_do_not_show_in_dumped_names(tmp_path):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = make_model()
    wrapped = torch.nn.Sequential(checkpoint_wrapper(model[0]), model[1])
    assert "0._checkpoint_wrapped_module.weight" in dict(wrapped.named_parameters())
    backward(wrapped)
    gradaudit.dump(wrapped, tmp_path, step=14, max_norm=MAX_NORM)
    assert {p.param for p in load_step(tmp_path / "step_14").ranks[0].pieces} == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    }


def test_wrapper_prefixes_are_removed_from_parameter_names():
    class Holder(torch.nn.Module):
        def __init__(self, inner, attr):
            super().__init__()
            setattr(self, attr, inner)

    inner = torch.nn.Linear(2, 2)
    compiled = Holder(Holder(inner, "_checkpoint_wrapped_module"), "_orig_mod")
    assert logical_name(compiled, "_orig_mod._checkpoint_wrapped_module.weight") == "weight"
    own_module = Holder(inner, "module")  # not a DDP wrapper: a user's submodule named `module` stays
    assert logical_name(own_module, "module.weight") == "module.weight"


def test_importing_gradaudit_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, gradaudit; gradaudit.__version__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_dump_from_an_optimizer_step_pre_hook_records_the_gradients_the_step_uses(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = {}

    def hook(optimizer, args, kwargs):
        seen["path"] = gradaudit.dump(model, tmp_path, step=12, max_norm=MAX_NORM)
        seen["grad"] = model[0].weight.grad.clone()

    handle = opt.register_step_pre_hook(hook)
    backward(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    handle.remove()
    step = load_step(tmp_path / "step_12")
    assert torch.equal(read(step, 0, "0.weight", "grad"), seen["grad"])


def test_explicit_ownership_replaces_inference_for_hand_rolled_sharding(tmp_path):
    from gradaudit.capture import LocalPiece
    from gradaudit.model import FlatRange

    model = make_model()
    backward(model)
    weight = model[0].weight  # pretend this rank owns elements [4, 12) of the flattened weight (ZeRO-style)
    piece = LocalPiece(
        param="0.weight",
        global_shape=(3, 4),
        dtype="float32",
        regions=(FlatRange(start=4, stop=12),),
        local_shape=(8,),
        grad=lambda: weight.grad.reshape(-1)[4:12],
        value=lambda: weight.detach().reshape(-1)[4:12],
        replica_group=None,
    )
    gradaudit.dump(model, tmp_path, step=13, max_norm=MAX_NORM, ownership=[piece])
    step = load_step(tmp_path / "step_13")
    (written,) = [p for p in step.ranks[0].pieces if p.param == "0.weight"]
    assert written.regions == (FlatRange(start=4, stop=12),)
    assert torch.equal(read(step, 0, "0.weight", "grad"), weight.grad.reshape(-1)[4:12])
    assert {p.param for p in step.ranks[0].pieces} == {"0.weight", "0.bias", "1.weight", "1.bias"}
