"""FSDP1 (FullyShardedDataParallel) on 4 gloo ranks: every strategy's inferred pieces cover each
parameter exactly once per shard group and reassemble to the single-process gradients; a step
through gradaudit.audit_step audits clean with FSDP's own clip_grad_norm_ and is diagnosed when the
local shards are clipped by torch.nn.utils.clip_grad_norm_.

All scenarios run in one spawn of 4 ranks (each spawn costs seconds): FULL_SHARD, SHARD_GRAD_OP and
NO_SHARD over all 4 ranks, HYBRID_SHARD as 2 replicas x 2 shards.
"""

from __future__ import annotations

import functools
import math
import os

import pytest
import torch
from launcher import run_ranks
from models import MAX_NORM, batch, loss_of, reference_grads_tiny, rows, tiny_net, write_reference_dump
from reassemble import audit_report, error_codes, load, norm_of, reassemble

pytestmark = pytest.mark.integration

WORLD_SIZE = 4
SHARD_GROUPS = ((0, 1), (2, 3))
REPLICATE_GROUPS = ((0, 2), (1, 3))
WHOLE_WORLD = ((0, 1, 2, 3),)


def _setup(
    strategy, use_orig_params=False, grouping=None, low_precision_grads=False, checkpointed=False
) -> dict:
    """How one case wraps TinyNet; `grouping` says how HYBRID_SHARD gets its groups (explicit
    (shard, replicate) process groups or a 2-D device mesh); `checkpointed` wraps fc2 in an
    activation-checkpoint wrapper, whose name must not leak into parameter names."""
    return {
        "strategy": strategy,
        "use_orig_params": use_orig_params,
        "grouping": grouping,
        "low_precision_grads": low_precision_grads,
        "checkpointed": checkpointed,
    }


INFERENCE_CASES = {
    "FULL_SHARD": _setup("FULL_SHARD"),
    "FULL_SHARD+orig": _setup("FULL_SHARD", use_orig_params=True),
    "SHARD_GRAD_OP": _setup("SHARD_GRAD_OP"),
    "SHARD_GRAD_OP+orig": _setup("SHARD_GRAD_OP", use_orig_params=True),
    "NO_SHARD": _setup("NO_SHARD"),
    "NO_SHARD+orig": _setup("NO_SHARD", use_orig_params=True),
    "HYBRID_SHARD": _setup("HYBRID_SHARD", grouping="process_groups"),
    "HYBRID_SHARD+orig": _setup("HYBRID_SHARD", use_orig_params=True, grouping="device_mesh"),
    "FULL_SHARD+orig+bf16_grads": _setup("FULL_SHARD", use_orig_params=True, low_precision_grads=True),
    "FULL_SHARD+checkpointed": _setup("FULL_SHARD", checkpointed=True),
}


# -- worker side (runs on each rank) ---------------------------------------------------------------


def _wrap_fsdp1(setup: dict, groups: dict):
    """TinyNet under FSDP1 with fc2 in its own FSDP unit, so the model has two FlatParameters."""
    import torch.nn as nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    kwargs = {}
    if setup["grouping"] == "process_groups":
        kwargs["process_group"] = groups["hybrid_pair"]
    elif setup["grouping"] == "device_mesh":
        kwargs["device_mesh"] = groups["mesh"]
    if setup["low_precision_grads"]:
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=True)
    fc2_alone = functools.partial(
        lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear) and m.in_features == 16
    )
    model = tiny_net()
    if setup["checkpointed"]:  # names then hold _checkpoint_wrapped_module as well
        model.fc2 = checkpoint_wrapper(model.fc2)
    return FullyShardedDataParallel(
        model,
        sharding_strategy=ShardingStrategy[setup["strategy"]],
        use_orig_params=setup["use_orig_params"],
        auto_wrap_policy=fc2_alone,
        device_id=torch.device("cpu"),
        **kwargs,
    )


def _backward(model, rank: int) -> None:
    x, y = batch()
    loss_of(model(rows(x, rank, WORLD_SIZE)), rows(y, rank, WORLD_SIZE)).backward()


def _described_pieces(model) -> dict:
    from gradaudit.capture.fsdp1 import fsdp1_groups, fsdp1_pieces

    pieces = []
    for piece in fsdp1_pieces(model):
        (region,) = piece.regions
        grad, value = piece.grad(), piece.value()
        pieces.append(
            {
                "param": piece.param,
                "start": region.start,
                "stop": region.stop,
                "global_shape": piece.global_shape,
                "local_shape": piece.local_shape,
                "dtype": piece.dtype,
                "replica_group": piece.replica_group,
                "grad": None if grad is None else grad.detach().clone(),
                "value": None if value is None else value.detach().clone(),
            }
        )
    return {"pieces": pieces, "groups": fsdp1_groups(model)}


def _audited_step(model, rank: int, out_dir: str, clip) -> dict:
    import gradaudit

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        _backward(model, rank)
        norm = clip(audit, model)
        opt.step()
    return {"returned_norm": float(norm), "path": str(audit.path)}


def _fsdp_own_clip(audit, model):
    return audit.clip(model.clip_grad_norm_, MAX_NORM)


def _local_shard_clip(audit, model):
    return audit.clip(torch.nn.utils.clip_grad_norm_, model.parameters(), MAX_NORM)


AUDITED_CASES = {
    # case: (inference case giving the wrapping, clipping)
    "fsdp1_ok": ("FULL_SHARD", _fsdp_own_clip),
    "fsdp1_hybrid_orig_ok": ("HYBRID_SHARD+orig", _fsdp_own_clip),
    "fsdp1_local_clip": ("FULL_SHARD", _local_shard_clip),
}


def all_fsdp1_cases(rank: int, world_size: int, out_root: str) -> dict:
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    assert world_size == WORLD_SIZE
    warnings.filterwarnings("ignore", category=FutureWarning)  # FSDP1 announces its deprecation
    shard_pgs = [dist.new_group(list(g)) for g in SHARD_GROUPS]
    replicate_pgs = [dist.new_group(list(g)) for g in REPLICATE_GROUPS]
    groups = {
        "hybrid_pair": (shard_pgs[rank // 2], replicate_pgs[rank % 2]),
        "mesh": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")),
    }
    inferred = {}
    for case, setup in INFERENCE_CASES.items():
        model = _wrap_fsdp1(setup, groups)
        _backward(model, rank)
        inferred[case] = _described_pieces(model)
    audited = {}
    for case, (setup_case, clip) in AUDITED_CASES.items():
        model = _wrap_fsdp1(INFERENCE_CASES[setup_case], groups)
        audited[case] = _audited_step(model, rank, os.path.join(out_root, case), clip)
    no_sync = {
        case: _grad_error_inside_no_sync(_wrap_fsdp1(INFERENCE_CASES[case], groups), rank)
        for case in NO_SYNC_CASES
    }
    ignored = _pieces_and_warnings_with_norm_ignored(rank)
    return {"inferred": inferred, "audited": audited, "no_sync": no_sync, "ignored": ignored}


def _pieces_and_warnings_with_norm_ignored(rank: int) -> dict:
    import warnings

    from torch.distributed.fsdp import FullyShardedDataParallel

    from gradaudit.capture.fsdp1 import fsdp1_pieces

    model = tiny_net()
    model = FullyShardedDataParallel(model, ignored_states=[model.norm], device_id=torch.device("cpu"))
    _backward(model, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = {p.param for p in fsdp1_pieces(model)}
    return {"params": names, "warnings": [str(w.message) for w in caught]}


NO_SYNC_CASES = ("FULL_SHARD", "FULL_SHARD+orig")


def _grad_error_inside_no_sync(model, rank: int) -> str | None:
    """The CaptureError message of reading a gradient that no_sync() left unsharded and unreduced."""
    from gradaudit.capture.fsdp1 import fsdp1_pieces
    from gradaudit.errors import CaptureError

    with model.no_sync():
        _backward(model, rank)
    try:
        for piece in fsdp1_pieces(model):
            piece.grad()
    except CaptureError as exc:
        return str(exc)
    return None


# -- test side -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_root = tmp_path_factory.mktemp("fsdp1")
    results = run_ranks(all_fsdp1_cases, WORLD_SIZE, (str(out_root),), timeout_s=240)
    return out_root, results


@pytest.fixture(scope="module")
def reference():
    grads = reference_grads_tiny()
    values = {name: p.detach().clone() for name, p in tiny_net().named_parameters()}
    return grads, values


def _case(runs, case: str) -> list[dict]:
    """Each rank's description of its pieces and groups for one inference case."""
    return [rank_result["inferred"][case] for rank_result in runs[1]]


def _holders(strategy: str) -> tuple[tuple[int, ...], ...]:
    """The sets of ranks that together hold one full copy of the model."""
    if strategy == "NO_SHARD":
        return tuple((r,) for r in range(WORLD_SIZE))
    if strategy == "HYBRID_SHARD":
        return SHARD_GROUPS
    return WHOLE_WORLD


def _assemble(described: list[dict], ranks: tuple[int, ...], kind: str, shapes: dict) -> dict:
    """Full tensors of `kind` from the pieces of `ranks`, asserting each element is held exactly once."""
    full = {name: torch.zeros(shape, dtype=torch.float64).reshape(-1) for name, shape in shapes.items()}
    count = {name: torch.zeros(math.prod(shape), dtype=torch.int64) for name, shape in shapes.items()}
    for rank in ranks:
        for piece in described[rank]["pieces"]:
            name = piece["param"]
            assert name in shapes, f"rank {rank} names an unknown parameter {name!r}"
            assert piece["global_shape"] == tuple(shapes[name])
            assert piece["local_shape"] == (piece["stop"] - piece["start"],)
            values = piece[kind]
            assert values.shape == piece["local_shape"], (name, rank)
            full[name][piece["start"] : piece["stop"]] += values.double()
            count[name][piece["start"] : piece["stop"]] += 1
    for name, held in count.items():
        assert bool((held == 1).all()), f"{name}: elements held {held.tolist()} times by ranks {ranks}"
    return {name: t.reshape(shapes[name]) for name, t in full.items()}


@pytest.mark.parametrize("case", list(INFERENCE_CASES))
def test_fsdp1_pieces_hold_each_element_once_per_model_copy_and_reassemble_to_the_reference(
    runs, reference, case
):
    strategy, low_precision = INFERENCE_CASES[case]["strategy"], INFERENCE_CASES[case]["low_precision_grads"]
    grads, values = reference
    shapes = {name: tuple(g.shape) for name, g in grads.items()}
    described = _case(runs, case)
    tolerance = 2e-2 if low_precision else 1e-5
    for ranks in _holders(strategy):
        assembled_grads = _assemble(described, ranks, "grad", shapes)
        assembled_values = _assemble(described, ranks, "value", shapes)
        for name, expected in grads.items():
            scale = max(1.0, float(expected.abs().max()))
            assert float((assembled_grads[name] - expected.double()).abs().max()) <= tolerance * scale, (
                name,
                ranks,
            )
            assert torch.equal(assembled_values[name].float(), values[name]), (name, ranks)


@pytest.mark.parametrize(
    "case, replica_group",
    [
        ("FULL_SHARD", None),
        ("SHARD_GRAD_OP+orig", None),
        ("NO_SHARD", "dp"),
        ("NO_SHARD+orig", "dp"),
        ("HYBRID_SHARD", "dp_replicate"),
        ("HYBRID_SHARD+orig", "dp_replicate"),
    ],
)
def test_fsdp1_replicas_are_flagged_with_the_group_they_are_replicated_over(runs, case, replica_group):
    for rank_view in _case(runs, case):
        assert {p["replica_group"] for p in rank_view["pieces"]} == {replica_group}


@pytest.mark.parametrize("case", ["HYBRID_SHARD", "HYBRID_SHARD+orig"])
def test_hybrid_shard_replicas_hold_the_same_ranges_with_equal_gradients(runs, case):
    described = _case(runs, case)
    for first, second in REPLICATE_GROUPS:
        left = {(p["param"], p["start"], p["stop"]): p["grad"] for p in described[first]["pieces"]}
        right = {(p["param"], p["start"], p["stop"]): p["grad"] for p in described[second]["pieces"]}
        assert sorted(left) == sorted(right)
        for key, grad in left.items():
            assert torch.allclose(grad, right[key], atol=1e-6), key


@pytest.mark.parametrize(
    "case, expected",
    [
        ("FULL_SHARD", lambda rank: {"dp_shard": WHOLE_WORLD}),
        ("SHARD_GRAD_OP+orig", lambda rank: {"dp_shard": WHOLE_WORLD}),
        ("NO_SHARD+orig", lambda rank: {"dp": WHOLE_WORLD}),
        (
            "HYBRID_SHARD",
            lambda rank: {
                "dp_shard": (SHARD_GROUPS[rank // 2],),
                "dp_replicate": (REPLICATE_GROUPS[rank % 2],),
            },
        ),
        (
            "HYBRID_SHARD+orig",
            lambda rank: {
                "dp_shard": (SHARD_GROUPS[rank // 2],),
                "dp_replicate": (REPLICATE_GROUPS[rank % 2],),
            },
        ),
    ],
)
def test_fsdp1_groups_give_each_rank_its_own_shard_and_replicate_rank_lists(runs, case, expected):
    for rank, rank_view in enumerate(_case(runs, case)):
        assert rank_view["groups"] == expected(rank)


def test_low_precision_gradients_are_read_as_they_are_while_the_piece_keeps_the_parameter_dtype(runs):
    for rank_view in _case(runs, "FULL_SHARD+orig+bf16_grads"):
        assert rank_view["pieces"]
        for piece in rank_view["pieces"]:
            assert piece["dtype"] == "float32"
            assert piece["grad"].dtype == torch.bfloat16
            assert piece["value"].dtype == torch.float32


def _audited(runs, case: str):
    out_root, results = runs
    step_path = out_root / case / "step_1"
    step = load(step_path)
    assert step.missing_ranks == ()
    grads = reassemble(step, "grad")
    reference = reference_grads_tiny()
    assert sorted(grads) == sorted(reference)
    for name, expected in reference.items():
        assert float((grads[name] - expected.double()).abs().max()) < 1e-5, name
    return step_path, norm_of(grads), [r["audited"][case]["returned_norm"] for r in results]


@pytest.fixture(scope="module")
def reference_dump(tmp_path_factory):
    return write_reference_dump(tmp_path_factory.mktemp("single_process"))


@pytest.mark.parametrize("case", ["fsdp1_ok", "fsdp1_hybrid_orig_ok"])
def test_fsdp1_step_clipped_by_fsdp_clip_grad_norm_audits_clean(runs, reference_dump, case):
    step_path, true_norm, returned = _audited(runs, case)
    assert all(math.isclose(true_norm, n, rel_tol=1e-5) for n in returned)
    assert math.isclose(norm_of(reassemble(load(step_path), "grad_clipped")), MAX_NORM, rel_tol=1e-4)
    report = audit_report(step_path, reference=reference_dump)
    if report is None:
        pytest.skip("gradaudit.audit is not there yet; the dump itself was verified above")
    assert math.isclose(report.global_norm, true_norm, rel_tol=1e-9)
    assert error_codes(report) == set()
    assert {c.param for c in report.reference} == set(
        reference_grads_tiny()
    )  # GA602/GA603 saw every parameter


def test_torch_clip_grad_norm_on_fsdp1_local_shards_is_diagnosed_as_a_local_norm(runs):
    step_path, true_norm, returned = _audited(runs, "fsdp1_local_clip")
    assert all(n < true_norm * (1 - 1e-3) for n in returned)
    report = audit_report(step_path)
    if report is None:
        pytest.skip("gradaudit.audit is not there yet; the dump itself was verified above")
    assert "GA201" in error_codes(report)


@pytest.mark.parametrize("case", NO_SYNC_CASES)
def test_reading_gradients_left_unreduced_by_no_sync_raises_a_capture_error(runs, case):
    for rank_result in runs[1]:
        message = rank_result["no_sync"][case]
        assert message is not None and "no_sync()" in message


def test_parameters_fsdp1_ignores_are_captured_as_replicas_with_a_warning_naming_them(runs):
    for rank_result in runs[1]:
        ignored = rank_result["ignored"]
        assert {"norm.weight", "norm.bias"} <= ignored["params"]
        assert any("norm.weight, norm.bias" in w and "whole replicas" in w for w in ignored["warnings"])
