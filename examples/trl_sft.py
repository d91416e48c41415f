"""TRL's SFTTrainer with the fused loss (needs ``pip install -e ".[examples]"``, i.e. trl).

    python examples/trl_sft.py                                    # tiny Llama, CPU or GPU, offline
    python examples/trl_sft.py --model Qwen/Qwen2.5-0.5B [--lora]  # a hub checkpoint or a local path

SFTTrainer is a transformers ``Trainer``, so the same callback works. Settings that matter:

* ``use_liger_kernel=False`` (the default): liger_patch replaces it; do not enable both.
* SFTTrainer computes its own loss and logs entropy and token accuracy (recent TRL through its
  own fused head, ``fused_lm_head=True``; older TRL from ``outputs.logits``). The trainer below
  instead takes the loss the patched model returns, as ``transformers.Trainer`` does, and so
  skips those two metrics (the loss is untouched). To keep them, use plain ``SFTTrainer``
  without the callback.

The default model is built from a config (2 layers, hidden 64, vocabulary 1000) with a byte-level
tokenizer built in this file, so nothing is downloaded; bf16 is used only where the GPU supports it.
"""

from __future__ import annotations

import argparse

import torch
from tiny_trl import arithmetic_chats, tiny_model, tiny_tokenizer
from transformers import Trainer
from trl import SFTConfig, SFTTrainer

from liger_patch import LigerPatchCallback


class FusedLossSFTTrainer(SFTTrainer):
    """SFTTrainer whose loss is the model's own (the fused one), without its logits-based metrics."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs["use_cache"] = False  # as SFTTrainer does: no KV cache while training
        return Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (needs peft)")
    parser.add_argument("--output-dir", default="out/trl_sft")
    args = parser.parse_args(argv)

    peft_config = None
    if args.lora:
        from peft import LoraConfig

        # LoRA on attention/MLP keeps the fused head; do not target lm_head (that falls back to
        # full logits). To train the head, use modules_to_save=["lm_head"]: that copy is fused.
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    config = SFTConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 10),
        learning_rate=2e-5 if args.model else 1e-3,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        use_liger_kernel=False,
        save_strategy="no",
        report_to=[],
    )
    trainer = FusedLossSFTTrainer(
        model=args.model or tiny_model(),
        args=config,
        train_dataset=arithmetic_chats(256),
        processing_class=None if args.model else tiny_tokenizer(),  # a hub model brings its own
        peft_config=peft_config,
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"first logged loss {losses[0]:.4f}, last logged loss {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
