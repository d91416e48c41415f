"""TRL's SFTTrainer, unmodified, with the fused loss (needs ``pip install -e ".[examples]"``, i.e. trl).

    python examples/trl_sft.py                                    # tiny Llama, CPU or GPU, offline
    python examples/trl_sft.py --model Qwen/Qwen2.5-0.5B [--lora]  # a hub checkpoint or a local path

One line: ``callbacks=[LigerPatchCallback()]``. TRL 1.15+ computes the SFT loss through its own
fused LM head (``fused_lm_head=True``), whose log-probs, entropy and token accuracy our op then
computes: the loss and the logged ``mean_token_accuracy`` and ``entropy`` are TRL's, without the
``tokens x vocab`` logits. Leave ``use_liger_kernel`` off, or on for liger-kernel's layer kernels
only (TRL keeps its fused head either way). If a step ever runs without the op, a
``LigerBypassWarning`` says what took over.

The default model is built from a config (2 layers, hidden 64, vocabulary 1000) with a byte-level
tokenizer from ``tiny_trl.py``, so nothing is downloaded; bf16 is used only where the GPU supports it.
"""

from __future__ import annotations

import argparse

import torch
from tiny_trl import arithmetic_chats, tiny_model, tiny_tokenizer
from trl import SFTConfig, SFTTrainer

from liger_patch import LigerPatchCallback


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
        save_strategy="no",
        report_to=[],
    )
    trainer = SFTTrainer(
        model=args.model or tiny_model(),
        args=config,
        train_dataset=arithmetic_chats(256),
        processing_class=None if args.model else tiny_tokenizer(),  # a hub model brings its own
        peft_config=peft_config,
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in (logged[0], logged[-1]):
        print(
            f"step {entry['step']}: loss {entry['loss']:.4f}  "
            f"mean_token_accuracy {entry['mean_token_accuracy']:.3f}  entropy {entry['entropy']:.3f}"
        )


if __name__ == "__main__":
    main()
