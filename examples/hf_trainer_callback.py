"""HF Trainer with LigerPatchCallback: add one callback, nothing else changes.

    python examples/hf_trainer_callback.py

The callback patches the model in ``on_init_end`` (before accelerate wraps ``forward`` for mixed
precision, so the fused loss runs under autocast) and, with ``z_loss_scale > 0``, adds
``z_loss`` to every training log line. Leave ``use_liger_kernel`` at False.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

from liger_patch import LigerPatchCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 128, vocab: int = 4096):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone()
        labels[:32] = -100
        return {"input_ids": self.ids[i], "labels": labels}


def main() -> None:
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    args = TrainingArguments(
        output_dir="out/hf_trainer_callback",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=10,
        logging_steps=2,
        learning_rate=1e-3,
        bf16=torch.cuda.is_available(),
        save_strategy="no",
        report_to=[],
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        eval_dataset=RandomTokens(16),
        callbacks=[LigerPatchCallback(z_loss_scale=1e-4)],
    )
    trainer.train()
    print(trainer.evaluate())  # eval runs the original forward: same eval_loss as without the patch
    print([entry for entry in trainer.state.log_history if "z_loss" in entry][-1])


if __name__ == "__main__":
    main()
