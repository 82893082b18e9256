"""Rank workers for DeepSpeed ZeRO stages 1-3 on 2 gloo ranks (CPU accelerator)."""

from __future__ import annotations

import os

from models import MAX_NORM, batch, loss_of, rows, tiny_net


def deepspeed_runs(rank: int, world_size: int, out_root: str) -> dict:
    import deepspeed

    from gradaudit.integrations.deepspeed import DeepSpeedAudit

    results = {}
    for stage in (1, 2, 3):
        name = f"zero{stage}_ok"
        model = tiny_net()
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": MAX_NORM,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
        )
        audit = DeepSpeedAudit(engine, os.path.join(out_root, name), steps=[1], strict=True)
        x, y = batch()
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        engine.backward(loss_of(engine(x), y))
        engine.step()
        results[name] = {"norm": float(engine.get_global_grad_norm()), "paths": [str(p) for p in audit.paths]}
        audit.remove()
        engine.destroy()
    return results


def _engine(stage: int, *, clipping: float, accumulation: int = 1):
    import deepspeed

    model = tiny_net()
    config = {
        "train_micro_batch_size_per_gpu": 4 // accumulation,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": clipping,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config, dist_init_required=False
    )
    return engine


def clip_zero3_by_hand(engine, *, reduce_norm: bool) -> float:
    """Clip ZeRO-3 gradients by hand through DeepSpeed's local-gradient API, as a user porting a custom
    clipping rule does. `reduce_norm=False` is the mistake: the norm of this rank's partitions only."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    params = [p for p in engine.module.parameters() if p.requires_grad]
    grads = [safe_get_local_grad(p) for p in params]
    sum_sq = torch.stack([g.double().square().sum() for g in grads]).sum()
    if reduce_norm:
        dist.all_reduce(sum_sq)
    norm = sum_sq.sqrt()
    coef = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
    for param, grad in zip(params, grads, strict=True):
        safe_set_local_grad(param, grad * coef.to(grad.dtype))
    return float(norm)


def deepspeed_hand_clipping_and_accumulation(rank: int, world_size: int, out_root: str) -> dict:
    """ZeRO-3 clipped by hand with the local norm (the mistake) and with the reduced one, and ZeRO-2 with
    gradient_accumulation_steps=2 clipped by DeepSpeed."""
    from gradaudit.integrations.deepspeed import DeepSpeedAudit

    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    results = {}
    for name, reduce_norm in (("zero3_local_norm", False), ("zero3_reduced_norm", True)):
        engine = _engine(3, clipping=0.0)
        audit = DeepSpeedAudit(
            engine, os.path.join(out_root, name), steps=[1], max_norm=MAX_NORM, strict=True
        )
        engine.backward(loss_of(engine(x), y))
        norm = clip_zero3_by_hand(engine, reduce_norm=reduce_norm)
        engine.step()
        results[name] = {"norm": norm, "paths": [str(p) for p in audit.paths]}
        audit.remove()
        engine.destroy()

    engine = _engine(2, clipping=MAX_NORM, accumulation=2)
    audit = DeepSpeedAudit(engine, os.path.join(out_root, "zero2_accumulation"), steps=[1], strict=True)
    for micro in range(2):
        engine.backward(loss_of(engine(rows(x, micro, 2)), rows(y, micro, 2)))
        engine.step()
    results["zero2_accumulation"] = {
        "norm": float(engine.get_global_grad_norm()),
        "paths": [str(p) for p in audit.paths],
    }
    audit.remove()
    engine.destroy()
    return results
