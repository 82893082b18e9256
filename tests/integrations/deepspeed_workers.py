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
