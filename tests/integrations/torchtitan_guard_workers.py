"""Rank workers for the guard beside torchtitan's clip on 4 gloo ranks: 2 pipeline stages x 2 FSDP2
ranks (the `MiniTrainer` of torchtitan_workers: torchtitan's own `dist_utils.clip_grad_norm_`)."""

from __future__ import annotations

import os
import warnings

from models import batch, rows
from torchtitan_workers import MiniTrainer

NUM_STEPS = 4
MISTAKE_AT = 3
"""The mistake run leaves out pp_mesh (the norm of this stage only) at this step and the next."""


def guarded_torchtitan(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradaudit.integrations.torchtitan_guard import TorchtitanGuard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp_shard"))
    results = {}
    for name in ("ok", "stage_norm"):
        trainer = MiniTrainer(mesh, reduce_over_pp=True)
        verdicts: list = []  # what a user logs with, through on_verdict= (see the README)
        attached = TorchtitanGuard(trainer, os.path.join(out_root, name), on_verdict=verdicts.append)
        x, y = batch()
        x, y = rows(x, trainer.dp_index, 2), rows(y, trainer.dp_index, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(NUM_STEPS):
                trainer.step += 1
                trainer.reduce_over_pp = name == "ok" or trainer.step < MISTAKE_AT
                trainer.train_step(x, y)
        attached.remove()
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in attached.guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "norms": trainer.grad_norms,
            "true_norms": [] if attached.guard.last is None else [attached.guard.last.true_norm],
            "verdicts": [(line.step, line.metrics()) for line in verdicts],
        }
    return results
