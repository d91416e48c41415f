"""TRL's DPOTrainer, unmodified, with the fused loss (needs ``pip install -e ".[examples]"``, i.e. trl).

    python examples/trl_dpo.py                                  # tiny Llama, CPU or GPU, offline
    python examples/trl_dpo.py --model Qwen/Qwen2.5-0.5B-Instruct   # a hub checkpoint or a local path

One line: ``callbacks=[LigerPatchCallback()]``. DPOTrainer (TRL 1.15+) takes the policy's
per-token log-probs of the chosen and rejected completions from its fused LM head; our op computes
them (with entropy and token accuracy), so no ``tokens x vocab`` logits are built for the policy.
The reference model, loaded by TRL from the same name, is not patched and keeps TRL's own kernel
(it runs without gradients, so its logits chunks are short-lived).

The default model is a tiny random Llama saved to ``<output-dir>/tiny`` with the byte-level
tokenizer of ``tiny_trl.py`` (nothing is downloaded): DPO loads its reference model from that
path, as it would from a hub name. bf16 is used only where the GPU supports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tiny_trl import arithmetic_preferences, tiny_checkpoint
from trl import DPOConfig, DPOTrainer

from liger_patch import LigerPatchCallback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta (default 0.1)")
    parser.add_argument("--output-dir", default="out/trl_dpo")
    args = parser.parse_args(argv)

    model = args.model or tiny_checkpoint(str(Path(args.output_dir) / "tiny"))
    config = DPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 10),
        learning_rate=5e-7 if args.model else 1e-3,
        beta=args.beta,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
    )
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=arithmetic_preferences(256),
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in (logged[0], logged[-1]):
        print(
            f"step {entry['step']}: loss {entry['loss']:.4f}  "
            f"rewards/margins {entry['rewards/margins']:.4f}  "
            f"rewards/accuracies {entry['rewards/accuracies']:.3f}"
        )


if __name__ == "__main__":
    main()
