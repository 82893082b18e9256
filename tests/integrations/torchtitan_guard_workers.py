"""Rank workers for the guard beside torchtitan's clip on 4 gloo ranks: 2 pipeline stages x 2 FSDP2
ranks (the `MiniTrainer` of torchtitan_workers: torchtitan's own `dist_utils.clip_grad_norm_`, and its
own MetricsProcessor logging to TensorBoard under OUT_ROOT/<run>_metrics every LOG_FREQ steps)."""

from __future__ import annotations

import os
import warnings

from models import batch, rows
from torchtitan_workers import MiniTrainer, metrics_processor

NUM_STEPS = 5
LOG_FREQ = 3
"""torchtitan's metrics.log_freq: it logs steps 1 and 3 (MISTAKE_AT)."""
MISTAKE_AT = 3
"""The mistake run leaves out pp_mesh (the norm of this stage only) from this step on: the next is
captured in full, the one after (5, not a step torchtitan logs) is an anomaly again."""


def guarded_torchtitan(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradaudit.integrations.torchtitan_guard import TorchtitanGuard

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp_shard"))
    results = {}
    for name in ("ok", "stage_norm", "no_metrics"):  # no_metrics: a trainer without a metrics_processor
        metrics = None
        if name != "no_metrics":
            metrics = metrics_processor(os.path.join(out_root, f"{name}_metrics"), world_size, LOG_FREQ)
        trainer = MiniTrainer(mesh, reduce_over_pp=True, metrics_processor=metrics)
        verdicts: list = []  # every checked step's line, through on_verdict= (see the README)
        attached = TorchtitanGuard(
            trainer,
            os.path.join(out_root, name),
            on_verdict=verdicts.append,
            late=name == "ok",  # as on GPU: each verdict read at the next step, or where torchtitan logs
        )
        x, y = batch()
        x, y = rows(x, trainer.dp_index, 2), rows(y, trainer.dp_index, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(NUM_STEPS):
                trainer.step += 1
                trainer.reduce_over_pp = name != "stage_norm" or trainer.step < MISTAKE_AT
                trainer.train_step(x, y)
        attached.remove()
        if metrics is not None:
            metrics.close()  # as torchtitan's Trainer.close: the TensorBoard events are on disk
        results[name] = {
            "log_restored": metrics is None or "log" not in vars(metrics),
            "anomalies": [(step, list(codes)) for step, codes in attached.guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "norms": trainer.grad_norms,
            "true_norms": [] if attached.guard.last is None else [attached.guard.last.true_norm],
            "verdicts": [(line.step, line.metrics()) for line in verdicts],
        }
    return results
