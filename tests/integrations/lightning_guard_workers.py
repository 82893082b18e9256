"""Rank workers for the guard under Lightning on 2 gloo ranks: DDP, 2 micro-batches per optimizer step,
Lightning's own clip, and optionally a user's own clip in `on_after_backward` (every micro-batch)."""

from __future__ import annotations

import os
import warnings

import torch
from models import MAX_NORM, batch, loss_of, rows, tiny_net

NUM_STEPS = 3
LATE_LOG_EVERY = 2
FP16_INIT_SCALE = 2.0**16
"""GradScaler's default, as Lightning's 16-mixed makes it on GPU."""


def _module(clip_in_hook: bool):
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net()

        def training_step(self, data, index):
            x, y = data
            return loss_of(self.net(x), y)

        def on_after_backward(self) -> None:
            if clip_in_hook:  # the mistake: a clip of each micro-batch's partial gradient
                torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    return Module()


def _logger():
    from lightning.pytorch.loggers import Logger

    class ListLogger(Logger):
        """A logger as TensorBoard's: it keeps the gradaudit metrics Lightning hands it, per step."""

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[dict] = []

        @property
        def name(self) -> str:
            return "list"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params, *args, **kwargs) -> None:
            pass

        def log_metrics(self, metrics, step=None) -> None:
            kept = {k: float(v) for k, v in metrics.items() if k.startswith("gradaudit/")}
            if kept:
                self.logged.append(kept)

    return ListLogger()


def guarded_fit(rank: int, world_size: int, out_root: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from gradaudit.integrations.lightning_guard import GuardCallback

    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    micro = [(rows(x, i, 2), rows(y, i, 2)) for i in range(2)]
    results = {}
    for name, clip_in_hook in (
        ("ok", False),
        ("hook_clip", True),
        ("fp16_ok", False),
        ("fp16_hook_clip", True),
        ("late", False),
    ):
        # late: the verdict read one step late, as on GPU; Lightning logs every LATE_LOG_EVERY steps
        late = name == "late"
        callback = GuardCallback(os.path.join(out_root, name), **({"late": True} if late else {}))
        logger = _logger() if late else False
        fp16 = name.startswith("fp16")
        trainer = pl.Trainer(
            # precision="16-mixed" becomes bf16 on CPU; Lightning's own 16-mixed plugin takes a CPU
            # GradScaler (the one it makes on GPU is torch.amp.GradScaler("cuda"))
            plugins=[
                MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=FP16_INIT_SCALE))
            ]
            if fp16
            else None,
            accelerator="cpu",
            devices=world_size,
            strategy=DDPStrategy(),
            max_steps=NUM_STEPS,
            gradient_clip_val=MAX_NORM,
            gradient_clip_algorithm="norm",
            callbacks=[callback],
            logger=logger,
            log_every_n_steps=LATE_LOG_EVERY if late else 50,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            accumulate_grad_batches=2,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = torch.utils.data.DataLoader(micro * NUM_STEPS, batch_size=None)
            trainer.fit(_module(clip_in_hook), loader)
        guard = callback.guard
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "scaler": guard.scaler is not None,
            "logged": {
                k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gradaudit/")
            },
            "logger": logger.logged if logger else [],
        }
    return results
