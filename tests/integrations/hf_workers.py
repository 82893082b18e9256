"""Rank workers for HF Trainer on 2 gloo ranks: a tiny Llama built from a config (no downloads)."""

from __future__ import annotations

import os

import torch

MAX_GRAD_NORM = 0.5
VOCAB = 32
SEQ = 8


class TokenData(torch.utils.data.Dataset):
    def __init__(self, num: int = 16) -> None:
        gen = torch.Generator().manual_seed(4)
        self.ids = torch.randint(0, VOCAB, (num, SEQ), generator=gen)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _args(out_dir: str, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=2,
        max_grad_norm=MAX_GRAD_NORM,
        learning_rate=1e-2,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        **kw,
    )


def hf_trainer_runs(rank: int, world_size: int, out_root: str) -> dict:
    from transformers import Trainer, TrainerCallback

    import gradaudit
    from gradaudit.integrations.transformers import GradAuditCallback

    results = {}
    for name, selection in (("hf_ddp_ok", {"steps": [2]}), ("hf_ddp_stats", {"every": 2, "mode": "stats"})):
        callback = GradAuditCallback(os.path.join(out_root, name), strict=True, **selection)
        trainer = Trainer(
            model=tiny_llama(),
            args=_args(os.path.join(out_root, f"trainer_{name}")),
            train_dataset=TokenData(),
        )
        trainer.add_callback(callback)
        trainer.train()
        results[name] = [str(p) for p in callback.paths]

    class DumpAfterClipping(TrainerCallback):
        """The mistake: dump() from on_pre_optimizer_step, after the Trainer has clipped."""

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if state.global_step + 1 == 2:
                gradaudit.dump(
                    model,
                    os.path.join(out_root, "hf_dump_after_clip"),
                    step=2,
                    max_norm=args.max_grad_norm,
                    strict=True,
                )

    trainer = Trainer(
        model=tiny_llama(), args=_args(os.path.join(out_root, "trainer_late")), train_dataset=TokenData()
    )
    trainer.add_callback(DumpAfterClipping())
    trainer.train()

    class ClipEveryMicroBatch(Trainer):
        """The mistake: a training_step override that clips each micro-batch's partial gradient too."""

        use_accelerator = False

        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.use_accelerator:
                self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
            return loss

    for name, use_accelerator in (
        ("hf_clip_per_micro_batch", False),
        ("hf_accelerator_clip_per_micro_batch", True),
    ):
        callback = GradAuditCallback(os.path.join(out_root, name), steps=[2], strict=True)
        trainer = ClipEveryMicroBatch(
            model=tiny_llama(),
            args=_args(os.path.join(out_root, f"trainer_{name}")),
            train_dataset=TokenData(),
        )
        trainer.use_accelerator = use_accelerator
        trainer.add_callback(callback)
        trainer.train()
        results[name] = [str(p) for p in callback.paths]
    return results


def hf_trainer_fp16_run(rank: int, world_size: int, out_root: str) -> list[str]:
    """fp16 with a GradScaler. Accelerate creates its scaler only off CPU (accelerator.py: fp16 and
    `self.device.type != "cpu"`), so a real CPU GradScaler is installed on the Trainer's Accelerator
    before train() prepares the optimizer; the scaling, unscaling and stepping are Accelerate's own."""
    from transformers import Trainer

    from gradaudit.integrations.transformers import GradAuditCallback

    callback = GradAuditCallback(os.path.join(out_root, "hf_fp16"), steps=[2], strict=True)
    trainer = Trainer(
        model=tiny_llama(),
        args=_args(os.path.join(out_root, "trainer_fp16"), fp16=True),
        train_dataset=TokenData(),
    )
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer.add_callback(callback)
    trainer.train()
    return [str(p) for p in callback.paths]
