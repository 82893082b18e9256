"""Rank workers for the guard under Accelerate on 2 gloo ranks: DDP, 2 micro-batches per optimizer step
(`accelerator.accumulate`), `accelerator.clip_grad_norm_`, and a tracker of Accelerate's own kind; a
spike (one step's targets scaled) with the guard's spike=, and one bit of one rank's reduced gradient
flipped before the clip."""

from __future__ import annotations

import os
import warnings

import torch
from accelerate_workers import _fp16_accelerator
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

NUM_MICROBATCHES = 2
NUM_STEPS = 4
MISTAKE_FROM = 3
"""The mistake runs clip on every micro-batch (also the ones that do not sync), or in fp16 clip with
torch's clip_grad_norm_ (the scaled gradients), from this step on."""
FP16_INIT_SCALE = 2.0**16
"""GradScaler's default, as Accelerate creates it on GPU."""


def _tracker():
    from accelerate.tracking import GeneralTracker

    class ListTracker(GeneralTracker):
        """A tracker as Accelerate's docs define custom ones: it keeps what accelerator.log gives it."""

        name = "list"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int | None, dict]] = []

        @property
        def tracker(self):
            return self.logged

        def store_init_configuration(self, values: dict) -> None:
            pass

        def log(self, values: dict, step: int | None = None, **kwargs) -> None:
            self.logged.append((step, dict(values)))

    return ListTracker()


def guarded_accelerate(rank: int, world_size: int, out_root: str) -> dict:
    from accelerate import Accelerator

    from gradaudit.integrations.accelerate_guard import accelerate_guard

    x, y = batch()
    x, y = rows(x, rank, world_size), rows(y, rank, world_size)
    results = {}
    for name in ("ok", "clip_every_microbatch", "spike", "replica_flip", "fp16_ok", "fp16_torch_clip"):
        tracker = _tracker()
        kwargs = {"gradient_accumulation_steps": NUM_MICROBATCHES, "log_with": [tracker]}
        fp16 = name.startswith("fp16")
        if fp16:
            # the mixed precision is process-wide state; the fp32 runs before set it (the process
            # group, PartialState, stays)
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()
        accelerator = (
            _fp16_accelerator(FP16_INIT_SCALE, **kwargs) if fp16 else Accelerator(cpu=True, **kwargs)
        )
        accelerator.init_trackers(name)
        model = tiny_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        options = {"spike": SPIKE} if name == "spike" else {}  # through accelerate_guard's keywords
        guard = accelerate_guard(
            accelerator, model, optimizer, os.path.join(out_root, name), max_norm=MAX_NORM, **options
        )
        norms, scales, sums = [], [], None
        num_steps = {"spike": SPIKE_STEPS, "replica_flip": FLIP_STEPS}.get(name, NUM_STEPS)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, num_steps + 1):
                for i in range(NUM_MICROBATCHES):
                    with accelerator.accumulate(model):
                        xs, ys = rows(x, i, NUM_MICROBATCHES), rows(y, i, NUM_MICROBATCHES)
                        spiked = name == "spike" and step == SPIKE_STEP
                        accelerator.backward(loss_of(model(xs), ys * TARGET_SCALE if spiked else ys))
                        if spiked and accelerator.sync_gradients:  # reduced, not clipped yet
                            sums = sum_sq_per_param(model.named_parameters())
                        flip = name == "replica_flip" and step == FLIP_STEP and rank == 1
                        if flip and accelerator.sync_gradients:
                            flip_one_bit(model.module.fc1.weight.grad)
                        wrong = name in ("clip_every_microbatch", "fp16_torch_clip") and step >= MISTAKE_FROM
                        if name == "fp16_torch_clip" and wrong and accelerator.sync_gradients:
                            # the mistake: torch's clip skips the unscale accelerator.clip_grad_norm_ makes
                            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
                        elif accelerator.sync_gradients or (wrong and not fp16):
                            norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                            if accelerator.sync_gradients:
                                norms.append(float(norm))
                        if fp16 and accelerator.sync_gradients:
                            scales.append(accelerator.scaler.get_scale())
                        optimizer.step()
                        optimizer.zero_grad()
        guard.remove()
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "dumps": [str(p) for p in guard.dumps],
            "sums": sums,
            "logged": tracker.logged,
            "norms": norms,
            "scales": scales,
        }
        accelerator.free_memory()
    return results
