"""Rank workers clipping with torchtitan's own `dist_utils.clip_grad_norm_` on 4 gloo ranks:
2 pipeline stages x 2 FSDP2 ranks of TinyNet (fc1, fc2 | norm, head).

`MiniTrainer` has the attributes and the `train_step` shape of torchtitan's Trainer that
TorchtitanAudit uses (model_parts, optimizers, parallel_dims, config.training.max_norm, step):
the real Trainer needs data sets and tokenizers that cannot be installed here; the clipping
function is torchtitan's own, and so is its `metrics_processor` when one is given (built by
`metrics_processor`, logged to as torchtitan's `train_step` does).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from models import MAX_NORM, batch, loss_of, rows, tiny_net


class FirstStage(torch.nn.Module):
    def __init__(self, net) -> None:
        super().__init__()
        self.fc1, self.fc2 = net.fc1, net.fc2

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class LastStage(torch.nn.Module):
    def __init__(self, net) -> None:
        super().__init__()
        self.norm, self.head = net.norm, net.head

    def forward(self, hidden):
        return self.head(self.norm(hidden))


def metrics_processor(dump_folder: str, world_size: int, log_freq: int):
    """torchtitan's own MetricsProcessor for 2 pp stages x world_size // 2 FSDP ranks, with TensorBoard
    under dump_folder, built as its Trainer builds it (`config.metrics.build(...)`). Only its
    DeviceMemoryMonitor, which reads CUDA memory statistics, is one that reports none where there is no
    CUDA (torchtitan has no CPU one; the loggers, the logging rank and `log` are torchtitan's)."""
    from unittest import mock

    from torchtitan.components import metrics
    from torchtitan.distributed import ParallelDims

    class NoDeviceMemory:
        device_name = "cpu"

        def get_peak_stats(self):
            return metrics.DeviceMemStats(-1, -1, -1, -1, -1, -1)

        def reset_peak_stats(self) -> None:
            pass

    dims = ParallelDims(
        dp_replicate=1, dp_shard=world_size // 2, cp=1, tp=1, pp=2, ep=1, world_size=world_size
    )
    config = metrics.MetricsProcessor.Config(enable_tensorboard=True, log_freq=log_freq)
    with mock.patch.object(
        metrics,
        "build_device_memory_monitor",
        metrics.build_device_memory_monitor if torch.cuda.is_available() else NoDeviceMemory,
    ):
        processor = config.build(parallel_dims=dims, dump_folder=dump_folder)
    processor.num_flops_per_token = 1  # the Trainer sets it from the model's size
    return processor


class MiniTrainer:
    def __init__(self, mesh, reduce_over_pp: bool, metrics_processor=None) -> None:
        from torch.distributed.fsdp import fully_shard

        self.pp_index, self.dp_index = mesh.get_coordinate()
        self.peer = int(mesh.mesh[1 - self.pp_index, self.dp_index].item())
        net = tiny_net()
        stage = FirstStage(net) if self.pp_index == 0 else LastStage(net)
        fully_shard(stage, mesh=mesh["dp_shard"])
        self.model_parts = [stage]
        self.optimizers = torch.optim.SGD(stage.parameters(), lr=0.1)
        pp_mesh = mesh["pp"]
        self.parallel_dims = SimpleNamespace(get_optional_mesh=lambda name: pp_mesh if name == "pp" else None)
        self.config = SimpleNamespace(training=SimpleNamespace(max_norm=MAX_NORM))
        self.step = 0
        self.reduce_over_pp = reduce_over_pp
        self.grad_norms: list[float] = []
        self.metrics_processor = metrics_processor

    def train_step(self, x, y) -> None:
        from torchtitan.distributed import utils as dist_utils

        stage = self.model_parts[0]
        loss = torch.tensor(-1.0)  # torchtitan's loss on a stage that is not the last
        if self.pp_index == 0:
            hidden = stage(x)
            dist.send(hidden.detach(), dst=self.peer)
            grad = torch.empty_like(hidden)
            dist.recv(grad, src=self.peer)
            hidden.backward(grad)
        else:
            hidden = torch.empty(x.shape[0], 8)
            dist.recv(hidden, src=self.peer)
            hidden.requires_grad_(True)
            loss = loss_of(stage(hidden), y)
            loss.backward()
            dist.send(hidden.grad, dst=self.peer)
        pp_mesh = self.parallel_dims.get_optional_mesh("pp") if self.reduce_over_pp else None
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()],
            self.config.training.max_norm,
            foreach=True,
            pp_mesh=pp_mesh,
            ep_enabled=False,
        )
        self.grad_norms.append(float(grad_norm))
        self.optimizers.step()
        self.optimizers.zero_grad()
        metrics = self.metrics_processor
        if metrics is not None:  # as torchtitan's train_step logs (its data loader counts the tokens)
            metrics.ntokens_since_last_log += y.numel()
            metrics.data_loading_times.append(0.0)
            if metrics.should_log(self.step):
                loss = float(loss.detach())
                metrics.log(self.step, loss, loss, float(grad_norm), extra_metrics={"n_tokens_seen": 0})


def torchtitan_runs(rank: int, world_size: int, out_root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradaudit.integrations.torchtitan import TorchtitanAudit

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("pp", "dp_shard"))
    results = {}
    for name, reduce_over_pp in (("torchtitan_pp_ok", True), ("torchtitan_pp_stage_norm", False)):
        trainer = MiniTrainer(mesh, reduce_over_pp)
        audit = TorchtitanAudit(trainer, os.path.join(out_root, name), steps=[2], strict=True)
        x, y = batch()
        x, y = rows(x, trainer.dp_index, 2), rows(y, trainer.dp_index, 2)
        for _ in range(2):
            trainer.step += 1
            trainer.train_step(x, y)
        results[name] = {"norms": trainer.grad_norms, "paths": [str(p) for p in audit.paths]}
    return results


class ExpertNet(torch.nn.Module):
    """fc1 and head sharded with FSDP2 over dp_shard; one expert per rank, sharded over the ep mesh."""

    def __init__(self, ep_mesh) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)
        experts = torch.randn(ep_mesh.size(), 8, 8) * 0.3
        self.experts = torch.nn.Parameter(distribute_tensor(experts, ep_mesh, [Shard(0)]))

    def forward(self, x):
        hidden = torch.relu(self.fc1(x))
        return self.head(hidden @ self.experts.to_local()[0])


def torchtitan_ep_run(rank: int, world_size: int, out_root: str) -> dict:
    """torchtitan's EP/non-EP split: the dense and the expert norms come from different meshes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.distributed import utils as dist_utils

    import gradaudit

    dense_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    ep_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    model = ExpertNet(ep_mesh)
    fully_shard(model.fc1, mesh=dense_mesh)
    fully_shard(model.head, mesh=dense_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    out_dir = os.path.join(out_root, "torchtitan_ep_ok")
    with gradaudit.audit_step(model, out_dir, step=1, max_norm=MAX_NORM, optimizer=opt, strict=True) as audit:
        loss_of(model(x), y).backward()
        norm = audit.clip(dist_utils.clip_grad_norm_, list(model.parameters()), MAX_NORM, ep_enabled=True)
        opt.step()
    return {"norm": float(norm), "path": str(audit.path)}
