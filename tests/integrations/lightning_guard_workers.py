"""Rank workers for the guard under Lightning on 2 gloo ranks: DDP, 2 micro-batches per optimizer step,
Lightning's own clip, and optionally a user's own clip in `on_after_backward` (every micro-batch) or a
clip made three times at one step, logged to Lightning's CSVLogger; a spike (one step's targets
scaled) with the guard's spike=, and one bit of one rank's reduced gradient flipped before the clip."""

from __future__ import annotations

import os
import warnings

import torch
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

NUM_STEPS = 3
LATE_LOG_EVERY = 2
CSV_STEPS = 6
CSV_LOG_EVERY = 2
"""The CSVLogger run: 6 steps, Lightning logging every 2nd."""
THRICE_AT = 3
"""The CSVLogger run's step that clips three times (GA501); the next is captured in full."""
FP16_INIT_SCALE = 2.0**16
"""GradScaler's default, as Lightning's 16-mixed makes it on GPU."""


def _module(clip_in_hook: bool, clip_thrice_at: int | None = None, fault: str = ""):
    """fault "spike": SPIKE_STEP's targets scaled, each parameter's Σg² read before the clip; fault
    "replica_flip": one bit of rank 1's reduced gradient of fc1 flipped at FLIP_STEP, before the clip."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_net()
            self.thrice: list[float] = []
            """The norms the three clip calls of step clip_thrice_at returned."""
            self.sums: dict[str, float] | None = None

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
        ):
            if self.trainer.global_step + 1 != clip_thrice_at:  # global_step: the steps taken before
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
                return
            for _ in range(3):  # the mistake: clipping the clipped gradients again
                self.thrice.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)))

        def training_step(self, data, index):
            x, y = data
            spiked = fault == "spike" and self.trainer.global_step + 1 == SPIKE_STEP
            return loss_of(self.net(x), y * TARGET_SCALE if spiked else y)

        def on_after_backward(self) -> None:
            if clip_in_hook:  # the mistake: a clip of each micro-batch's partial gradient
                torch.nn.utils.clip_grad_norm_(self.parameters(), MAX_NORM)

        def on_before_optimizer_step(self, optimizer) -> None:  # the micro-batches reduced, not clipped
            step = self.trainer.global_step + 1
            if fault == "spike" and step == SPIKE_STEP:
                self.sums = sum_sq_per_param(self.named_parameters())
            if fault == "replica_flip" and step == FLIP_STEP and self.global_rank == 1:
                flip_one_bit(self.net.fc1.weight.grad)

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
                self.logged.append((step, kept))

    return ListLogger()


def guarded_fit(rank: int, world_size: int, out_root: str) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger
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
        ("csv", False),
        ("csv_late", False),
        ("spike", False),
        ("replica_flip", False),
    ):
        # late: the verdict read one step late, as on GPU; Lightning logs every LATE_LOG_EVERY steps
        late = name.endswith("late")
        # the guard's keywords (late=, spike=) go through the callback's
        options = {"late": True} if late else {"spike": SPIKE} if name == "spike" else {}
        callback = GuardCallback(os.path.join(out_root, name), **options)
        csv = name.startswith("csv")
        logger = CSVLogger(os.path.join(out_root, f"{name}_logs")) if csv else _logger() if late else False
        num_steps = {"spike": SPIKE_STEPS, "replica_flip": FLIP_STEPS}.get(
            name, CSV_STEPS if csv else NUM_STEPS
        )
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
            max_steps=num_steps,
            gradient_clip_val=MAX_NORM,
            gradient_clip_algorithm="norm",
            callbacks=[callback],
            logger=logger,
            log_every_n_steps=CSV_LOG_EVERY if csv else LATE_LOG_EVERY if late else 50,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            accumulate_grad_batches=2,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = torch.utils.data.DataLoader(micro * num_steps, batch_size=None)
            module = _module(clip_in_hook, THRICE_AT if csv else None, name)
            trainer.fit(module, loader)
        guard = callback.guard
        results[name] = {
            "thrice": module.thrice,
            "sums": module.sums,
            "dumps": [str(p) for p in guard.dumps],
            "csv": os.path.join(logger.log_dir, "metrics.csv") if csv else None,
            "anomalies": [(step, list(codes)) for step, codes in guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "scaler": guard.scaler is not None,
            "logged": {
                k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gradaudit/")
            },
            "logger": logger.logged if late and not csv else [],
        }
    return results
