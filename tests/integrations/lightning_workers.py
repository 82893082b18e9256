"""Rank workers for Lightning Trainer on 2 gloo ranks (the launcher's process group is reused)."""

from __future__ import annotations

import os

import torch
from models import MAX_NORM, batch, loss_of, rows, tiny_net

NUM_STEPS = 2


def _lightning_module(shard: bool, local_clip: bool, hook_clip: bool = False):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net()

        def configure_model(self) -> None:
            if not shard:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for module in (self.net.fc1, self.net.fc2, self.net.norm, self.net.head):
                fully_shard(module, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, data, index):
            x, y = data
            return loss_of(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_after_backward(self) -> None:
            if hook_clip:  # the mistake: each micro-batch's partial gradient is clipped too
                torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ):
            if not local_clip:
                return super().configure_gradient_clipping(
                    optimizer, gradient_clip_val, gradient_clip_algorithm
                )
            # The mistake: each rank clips by the norm of its own shards.
            grads = [p.grad.to_local() for p in self.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = torch.clamp(gradient_clip_val / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef)

    return Module()


def _loader(rank: int, world_size: int, accumulate: int = 1):
    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    # The same local batch every optimizer step, in `accumulate` micro-batches.
    micro = [(rows(x, i, accumulate), rows(y, i, accumulate)) for i in range(accumulate)]
    return torch.utils.data.DataLoader(micro * NUM_STEPS, batch_size=None)


def lightning_runs(rank: int, world_size: int, out_root: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from gradaudit.integrations.lightning import GradAuditCallback

    runs = {
        "lightning_ddp_ok": (lambda: DDPStrategy(), False, False),
        "lightning_ddp_accumulate_hook_clip": (lambda: DDPStrategy(), False, False),
        "lightning_ddp_accumulate_ok": (lambda: DDPStrategy(), False, False),
        "lightning_fsdp2_ok": (
            lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            True,
            False,
        ),
        "lightning_fsdp2_local_clip": (
            lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            True,
            True,
        ),
    }
    results = {}
    for name, (strategy, shard, local_clip) in runs.items():
        accumulate = 2 if "accumulate" in name else 1
        callback = GradAuditCallback(os.path.join(out_root, name), steps=[2], strict=True)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy(),
            max_steps=NUM_STEPS,
            gradient_clip_val=MAX_NORM,
            gradient_clip_algorithm="norm",
            callbacks=[callback],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            accumulate_grad_batches=accumulate,
        )
        module = _lightning_module(shard, local_clip, hook_clip="hook_clip" in name)
        trainer.fit(module, _loader(rank, world_size, accumulate))
        results[name] = [str(p) for p in callback.paths]
    return results
