"""TRL's SFTTrainer with the fused loss (needs ``pip install trl datasets``).

    python examples/trl_sft.py --model Qwen/Qwen2.5-0.5B

SFTTrainer is a transformers ``Trainer``, so the same callback works. Two TRL settings matter:

* ``use_liger_kernel=False`` (the default): liger_patch replaces it; do not enable both.
* TRL's ``compute_loss`` logs entropy and token accuracy computed from ``outputs.logits``
  unless ``use_liger_kernel=True``. A fused training step builds no logits, so the trainer
  below skips those two metrics (the loss is untouched). To keep them instead, set
  ``LIGER_RETURN_LOGITS=1`` and use plain ``SFTTrainer``: same loss, but the logits memory
  comes back.
"""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import Trainer
from trl import SFTConfig, SFTTrainer

from liger_patch import LigerPatchCallback


class FusedLossSFTTrainer(SFTTrainer):
    """SFTTrainer without its logits-based metrics, which a fused step cannot feed."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs["use_cache"] = False  # as SFTTrainer does: no KV cache while training
        return Trainer.compute_loss(
            self, model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen2.5-0.5B")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (needs peft)")
    args = parser.parse_args()

    dataset = Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": f"What is {i} + {i}?"},
                    {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
                ]
            }
            for i in range(256)
        ]
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        # LoRA on attention/MLP keeps the fused head; do not target lm_head (that falls back to
        # full logits). To train the head, use modules_to_save=["lm_head"]: that copy is fused.
        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    config = SFTConfig(
        output_dir="out/trl_sft",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=50,
        logging_steps=5,
        learning_rate=2e-5,
        bf16=True,
        use_liger_kernel=False,
        report_to=[],
    )
    trainer = FusedLossSFTTrainer(
        model=args.model,
        args=config,
        train_dataset=dataset,
        peft_config=peft_config,
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()


if __name__ == "__main__":
    main()
