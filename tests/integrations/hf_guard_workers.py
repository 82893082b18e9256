"""Rank workers for the guard under HF Trainer on 2 gloo ranks: 2 micro-batches per optimizer step,
the Trainer's own clip, and optionally a `training_step` override that also clips each micro-batch
(then over 4 steps, the Trainer logging every 2nd); a spike (one step's loss scaled) with the guard's
spike=, and one bit of one rank's reduced gradient flipped before the Trainer's clip."""

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
from hf_workers import MAX_GRAD_NORM, TokenData, _args, tiny_llama

FP16_STEPS = 6
STEP_CLIP_STEPS = 4
STEP_CLIP_LOGGING_STEPS = 2


def guarded_train(rank: int, world_size: int, out_root: str) -> dict:
    from transformers import Trainer, TrainerCallback

    class Recorder(TrainerCallback):
        """A reporting callback as TensorBoard's: before the user's in the Trainer's list."""

        def __init__(self) -> None:
            self.logged: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append({**(logs or {}), "at_step": state.global_step})

    from gradaudit.integrations.transformers_guard import GuardCallback

    class ClippingTrainer(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)  # the mistake
            return loss

    class FaultTrainer(Trainer):
        """spike: SPIKE_STEP's loss scaled (the labels are token ids), and each parameter's Σg² read once
        the step's micro-batches are reduced; replica_flip: one bit of rank 1's reduced gradient of
        lm_head flipped at FLIP_STEP, before the Trainer's clip."""

        fault = ""
        sums: dict[str, float] | None = None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            spiked = self.fault == "spike" and self.state.global_step + 1 == SPIKE_STEP
            return loss * TARGET_SCALE if spiked else loss

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            step = self.state.global_step + 1
            if self.accelerator.sync_gradients:  # the step's last micro-batch: the gradients are reduced
                if self.fault == "spike" and step == SPIKE_STEP:
                    self.sums = sum_sq_per_param(model.named_parameters())
                if self.fault == "replica_flip" and step == FLIP_STEP and self.args.process_index == 1:
                    flip_one_bit(dict(model.named_parameters())["module.lm_head.weight"].grad)
            return loss

    results = {}
    for name, trainer_class in (
        ("ok", Trainer),
        ("step_clip", ClippingTrainer),
        ("spike", FaultTrainer),
        ("replica_flip", FaultTrainer),
        ("fp16_ok", Trainer),
        ("fp16_step_clip", ClippingTrainer),
    ):
        fp16 = name.startswith("fp16")
        if fp16:  # the mixed precision is process-wide state, which the fp32 runs set
            from accelerate.state import AcceleratorState

            AcceleratorState._reset_state()
        # the guard's spike= goes through the callback's keywords
        options = {"spike": SPIKE} if name == "spike" else {}
        callback, recorder = GuardCallback(os.path.join(out_root, name), **options), Recorder()
        args = _args(os.path.join(out_root, f"trainer_{name}"), fp16=fp16)
        step_clip = name == "step_clip"
        args.set_logging(
            strategy="steps", steps=STEP_CLIP_LOGGING_STEPS if step_clip else 1, report_to="none"
        )
        if step_clip:
            args.max_steps = STEP_CLIP_STEPS
        args.max_steps = {"spike": SPIKE_STEPS, "replica_flip": FLIP_STEPS}.get(name, args.max_steps)
        trainer = trainer_class(
            model=tiny_llama(), args=args, train_dataset=TokenData(), callbacks=[recorder]
        )
        if trainer_class is FaultTrainer:
            trainer.fault = name
        if fp16:
            # Accelerate creates its GradScaler only off CPU (accelerator.py: fp16 and device type not
            # "cpu"): the one it would create is installed before train() hands it to its optimizer
            trainer.accelerator.native_amp = True
            trainer.accelerator.scaler = torch.amp.GradScaler("cpu")  # 2**16, as on GPU
            args.max_steps = FP16_STEPS
        trainer.add_callback(callback)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        assert callback.guard is not None
        results[name] = {
            "anomalies": [(step, list(codes)) for step, codes in callback.guard.anomalies],
            "dumps": [str(p) for p in callback.guard.dumps],
            "sums": getattr(trainer, "sums", None),
            "warnings": [str(w.message) for w in caught if "gradaudit guard" in str(w.message)],
            "reported": [log for log in recorder.logged if "grad_norm" in log],
            "history": [log for log in trainer.state.log_history if "grad_norm" in log],
            # the values of a step the Trainer does not log, as the guard's callback logs them
            "reported_alone": [
                log for log in recorder.logged if "loss" not in log and "train_loss" not in log
            ],
            "history_alone": [
                log for log in trainer.state.log_history if "loss" not in log and "train_loss" not in log
            ],
            "scaler": callback.guard.scaler is not None,
        }
    return results
