"""Rank workers for the guard beside torchtitan's clip on 4 gloo ranks: 2 pipeline stages x 2 FSDP2
ranks (the `MiniTrainer` of torchtitan_workers: torchtitan's own `dist_utils.clip_grad_norm_`, and its
own MetricsProcessor logging to TensorBoard under OUT_ROOT/<run>_metrics every LOG_FREQ steps); a spike
(one step's targets scaled) with the guard's spike= on those stages, and under HSDP (2 replicas x 2
FSDP2 ranks, no pp) one bit of one rank's reduced gradient flipped before torchtitan's clip."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from guard_spike_replica import (
    FLIP_STEP,
    FLIP_STEPS,
    SPIKE,
    SPIKE_STEP,
    SPIKE_STEPS,
    TARGET_SCALE,
    flip_one_bit,
    sum_sq_per_param,
)
from models import MAX_NORM, batch, loss_of, rows, tiny_net
from torchtitan_workers import MiniTrainer, metrics_processor

NUM_STEPS = 5
LOG_FREQ = 3
"""torchtitan's metrics.log_freq: it logs steps 1 and 3 (MISTAKE_AT)."""
MISTAKE_AT = 3
"""The mistake run leaves out pp_mesh (the norm of this stage only) from this step on: the next is
captured in full, the one after (5, not a step torchtitan logs) is an anomaly again."""
FLIP_RANK = 3
"""The HSDP run's rank whose gradient copy is flipped: its replica over dp_replicate is rank 1."""


class HSDPTrainer:
    """What TorchtitanGuard reads of torchtitan's Trainer, for TinyNet under HSDP on `mesh`
    (dp_replicate x dp_shard) without pp, clipping with torchtitan's own `dist_utils.clip_grad_norm_`;
    rank FLIP_RANK flips one bit of its reduced gradient of fc1 at FLIP_STEP, before the clip."""

    def __init__(self, mesh) -> None:
        from torch.distributed.fsdp import fully_shard

        model = tiny_net()
        for module in (model.fc1, model.fc2, model.norm, model.head):
            fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model_parts = [model]
        self.optimizers = torch.optim.SGD(model.parameters(), lr=0.1)
        self.parallel_dims = SimpleNamespace(get_optional_mesh=lambda name: None)
        self.config = SimpleNamespace(training=SimpleNamespace(max_norm=MAX_NORM))
        self.step = 0
        self.replica_index = mesh.get_local_rank(0)

    def train_step(self, x, y) -> None:
        from torchtitan.distributed import utils as dist_utils

        model = self.model_parts[0]
        loss_of(model(x), y).backward()  # FSDP2 reduces over both mesh dimensions here
        if self.step == FLIP_STEP and dist.get_rank() == FLIP_RANK:
            flip_one_bit(model.fc1.weight.grad)
        dist_utils.clip_grad_norm_(
            list(model.parameters()), MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False
        )
        self.optimizers.step()
        self.optimizers.zero_grad()


def spike_and_flip(world_size: int, out_root: str, pp_mesh) -> dict:
    """spike: the pp x FSDP2 MiniTrainer with spike=, SPIKE_STEP's targets scaled, and this stage's
    parameters' Σg² read at that step's optimizer step (after the clip, which scales every gradient
    alike); hsdp_flip: HSDPTrainer."""
    from torch.distributed.device_mesh import init_device_mesh

    from gradaudit.integrations.torchtitan_guard import TorchtitanGuard

    hsdp_mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    results = {}
    for name in ("spike", "hsdp_flip"):
        trainer = MiniTrainer(pp_mesh, reduce_over_pp=True) if name == "spike" else HSDPTrainer(hsdp_mesh)
        sums: dict[str, float] = {}

        def read_sums(optimizer, args, kwargs, trainer=trainer, sums=sums) -> None:
            if trainer.step == SPIKE_STEP:
                sums.update(sum_sq_per_param(trainer.model_parts[0].named_parameters()))

        if name == "spike":
            trainer.optimizers.register_step_pre_hook(read_sums)
        options = {"spike": SPIKE} if name == "spike" else {}  # through TorchtitanGuard's keywords
        attached = TorchtitanGuard(trainer, os.path.join(out_root, name), **options)
        x, y = batch()
        index = trainer.dp_index if name == "spike" else trainer.replica_index
        x, y = rows(x, index, 2), rows(y, index, 2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(SPIKE_STEPS if name == "spike" else FLIP_STEPS):
                trainer.step += 1
                spiked = name == "spike" and trainer.step == SPIKE_STEP
                trainer.train_step(x, y * TARGET_SCALE if spiked else y)
        attached.remove()
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in attached.guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "dumps": [str(p) for p in attached.guard.dumps],
            "sums": sums,
        }
    return results


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
    return {**results, **spike_and_flip(world_size, out_root, mesh)}
