"""Rank workers for the guard under Accelerate on 2 gloo ranks: DDP, 2 micro-batches per optimizer step
(`accelerator.accumulate`), `accelerator.clip_grad_norm_`, and a tracker of Accelerate's own kind."""

from __future__ import annotations

import os
import warnings

import torch
from models import MAX_NORM, batch, loss_of, rows, tiny_net

NUM_MICROBATCHES = 2
NUM_STEPS = 4
MISTAKE_FROM = 3
"""The mistake run clips on every micro-batch (also the ones that do not sync) from this step on."""


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
    for name in ("ok", "clip_every_microbatch"):
        tracker = _tracker()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=NUM_MICROBATCHES, log_with=[tracker])
        accelerator.init_trackers(name)
        model = tiny_net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        guard = accelerate_guard(
            accelerator, model, optimizer, os.path.join(out_root, name), max_norm=MAX_NORM
        )
        norms = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, NUM_STEPS + 1):
                for i in range(NUM_MICROBATCHES):
                    with accelerator.accumulate(model):
                        xs, ys = rows(x, i, NUM_MICROBATCHES), rows(y, i, NUM_MICROBATCHES)
                        accelerator.backward(loss_of(model(xs), ys))
                        wrong = name != "ok" and step >= MISTAKE_FROM
                        if accelerator.sync_gradients or wrong:
                            norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                            if accelerator.sync_gradients:
                                norms.append(float(norm))
                        optimizer.step()
                        optimizer.zero_grad()
        guard.remove()
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in guard.anomalies],
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "logged": tracker.logged,
            "norms": norms,
        }
        accelerator.free_memory()
    return results
