"""HF Trainer with LigerPatchCallback: add one callback, nothing else changes.

    python examples/hf_trainer_callback.py                            # tiny Llama, CPU or GPU, offline
    python examples/hf_trainer_callback.py --model Qwen/Qwen2.5-0.5B  # a hub checkpoint or a local path

The callback patches the model in ``on_init_end`` (before accelerate wraps ``forward`` for mixed
precision, so the fused loss runs under autocast) and, with ``z_loss_scale > 0``, adds
``z_loss`` to every training log line. Leave ``use_liger_kernel`` at False. The default model is
built from a config (2 layers, hidden 64, vocabulary 1000) and trained on random tokens: nothing
is downloaded. bf16 is used only where the GPU supports it.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from liger_patch import LigerPatchCallback


class RandomTokens(torch.utils.data.Dataset):
    """``n`` random sequences whose first quarter is an ignored prompt."""

    def __init__(self, n: int, vocab: int, seq: int = 128):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[: len(labels) // 4] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def load_model(name: str | None):
    """A hub/local checkpoint, or, without ``name``, a tiny random Llama."""
    if name:
        return AutoModelForCausalLM.from_pretrained(name)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    parser.add_argument("--output-dir", default="out/hf_trainer_callback")
    args = parser.parse_args(argv)

    model = load_model(args.model)
    vocab = model.config.vocab_size
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 5),
        learning_rate=1e-3,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(64, vocab),
        eval_dataset=RandomTokens(16, vocab),
        callbacks=[LigerPatchCallback(z_loss_scale=1e-4)],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "z_loss" in entry]
    print(f"last logged step: loss {logged[-1]['loss']:.4f}  z_loss {logged[-1]['z_loss']:.2e}")
    # Evaluation runs the original forward: the same eval_loss as without the patch.
    print(f"eval: loss {trainer.evaluate()['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
