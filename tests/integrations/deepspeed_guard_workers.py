"""Rank workers for the guard under DeepSpeed ZeRO stages 1-3 on 2 gloo ranks (CPU accelerator):
DeepSpeed's own clip (gradient_clipping) with 2 micro-batches per step, and a norm that is not reduced
over the data-parallel group at one step (the mistake, put into ZeRO's own norm computation), or ZeRO
clipping to another max_norm than the config's at one step (its clip_grad changed); and DeepSpeed's
own loss scaling (static, and dynamic as fp16 makes it), on fp32 engines (the CPU accelerator refuses fp16);
a spike (one step's targets scaled) with the guard's spike=."""

from __future__ import annotations

import os
import warnings

import torch
from guard_spike_replica import SPIKE, SPIKE_STEP, SPIKE_STEPS, TARGET_SCALE, sum_sq_per_param
from models import MAX_NORM, batch, loss_of, rows, tiny_net

NUM_STEPS = 4
CORRECT_STEPS = 20
"""The correct runs (zero1, zero2, zero3, zero1_loss_scale) go this many steps; the others NUM_STEPS."""
CORRECT_RUNS = ("zero1", "zero2", "zero3", "zero1_loss_scale")
MISTAKE_AT = 3
LOSS_SCALE = 1024.0
UNCLIPPED = 100.0
"""A gradient_clipping no step's norm reaches: the coefficient is 1 every step."""
SCALE_GROWTH_AT = 3
"""zero2_scale_growth: the step whose end doubles the loss scale (DynamicLossScaler, scale_window=2)."""


def _engine(stage: int, clipping: float = MAX_NORM):
    import deepspeed

    model = tiny_net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": clipping,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    return engine


def _norm_over_one_rank(engine, own_group):
    """ZeRO-1/2's own norm of the partitions, its all-reduce given a group of this rank alone: the norm
    every rank clips with is its own partitions' (a norm reduced over the wrong group)."""
    optimizer = engine.optimizer
    original = optimizer.get_grad_norm_direct

    def local(*args, **kwargs):
        group, optimizer.dp_process_group = optimizer.dp_process_group, own_group
        try:
            return original(*args, **kwargs)
        finally:
            optimizer.dp_process_group = group

    return local


def _global_sums(engine, x_all, y_all) -> dict[str, float]:
    """Each parameter's Σg² on the whole batch of every rank and micro-batch, of a copy of the engine's
    model (whole on every rank under ZeRO-1/2): the gradient ZeRO averages, up to a factor the shares
    do not see, read without its partitions."""
    whole = tiny_net()
    whole.load_state_dict(engine.module.state_dict())
    loss_of(whole(x_all), y_all).backward()
    return sum_sq_per_param(whole.named_parameters())


def guarded_deepspeed(rank: int, world_size: int, out_root: str) -> dict:
    import torch.distributed as dist

    from gradaudit.integrations.deepspeed_guard import DeepSpeedGuard

    own_groups = [dist.new_group([r]) for r in range(world_size)]
    x_all, y_all = batch()
    x, y = rows(x_all, rank, world_size), rows(y_all, rank, world_size)
    results = {}
    for name, stage in (
        ("zero1", 1),
        ("zero2", 2),
        ("zero3", 3),
        ("zero2_local_norm", 2),
        ("zero3_other_max_norm", 3),
        ("zero1_loss_scale", 1),
        ("zero2_scale_growth", 2),
        ("zero2_spike", 2),
    ):
        engine = _engine(stage, UNCLIPPED if name == "zero2_scale_growth" else MAX_NORM)
        if name == "zero1_loss_scale":
            # DeepSpeed's static loss scaling, as fp16 runs it (fp16 is refused on the CPU accelerator):
            # engine.backward multiplies the loss by it, ZeRO divides it out with its clip factor
            engine.optimizer.loss_scale = LOSS_SCALE
        if name == "zero2_scale_growth":
            # DeepSpeed's dynamic loss scaler as fp16 makes it, growing every 2 steps without overflow
            from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

            engine.optimizer.loss_scaler = DynamicLossScaler(
                init_scale=LOSS_SCALE,
                scale_window=2,
                min_scale=1.0,
                delayed_shift=1,
                consecutive_hysteresis=False,
                dtype=torch.half,
            )
        options = {"spike": SPIKE} if name == "zero2_spike" else {}  # through DeepSpeedGuard's keywords
        attached = DeepSpeedGuard(engine, os.path.join(out_root, name), **options)
        norms, sums = [], None
        num_steps = (
            SPIKE_STEPS if name == "zero2_spike" else CORRECT_STEPS if name in CORRECT_RUNS else NUM_STEPS
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, num_steps + 1):
                if name == "zero2_local_norm" and step == MISTAKE_AT:
                    engine.optimizer.get_grad_norm_direct = _norm_over_one_rank(engine, own_groups[rank])
                if name == "zero2_local_norm" and step == MISTAKE_AT + 1:
                    del engine.optimizer.get_grad_norm_direct
                if name == "zero3_other_max_norm":  # ZeRO clips to twice the config's, at one step
                    engine.optimizer.clip_grad = MAX_NORM * (2 if step == MISTAKE_AT else 1)
                spiked = name == "zero2_spike" and step == SPIKE_STEP
                if spiked:
                    sums = _global_sums(engine, x_all, y_all * TARGET_SCALE)
                for micro in range(2):
                    target = rows(y, micro, 2) * (TARGET_SCALE if spiked else 1.0)
                    engine.backward(loss_of(engine(rows(x, micro, 2)), target))
                    engine.step()
                norms.append(float(engine.get_global_grad_norm()))
        attached.remove()
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in attached.guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "norms": norms,
            "sums": sums,
            "dumps": [str(p) for p in attached.guard.dumps],
            "last": None if attached.guard.last is None else attached.guard.last.to_json(),
        }
        engine.destroy()
    return results
