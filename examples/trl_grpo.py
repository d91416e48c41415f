"""TRL's GRPOTrainer, unmodified, with the fused loss (needs ``pip install -e ".[examples]"``, i.e. trl).

    python examples/trl_grpo.py                                 # tiny Llama, CPU or GPU, offline
    python examples/trl_grpo.py --model Qwen/Qwen2.5-0.5B-Instruct  # a hub checkpoint or a local path

One line: ``callbacks=[LigerPatchCallback()]``. GRPOTrainer (TRL 1.15+) takes the policy's
per-token log-probs at the sampling temperature, and their entropy, from its fused LM head; our
op computes them, so no ``tokens x vocab`` logits are built for the policy. With ``--beta`` above
0 TRL loads a reference model from the same name: it is not patched and keeps TRL's own kernel.
Generation (``model.generate``) is untouched.

The reward is a toy (the share of digits in each completion, ``tiny_trl.digit_reward``). The
default model is a tiny random Llama saved to ``<output-dir>/tiny`` with the byte-level tokenizer
of ``tiny_trl.py``, so nothing is downloaded. bf16 is used only where the GPU supports it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tiny_trl import arithmetic_prompts, digit_reward, tiny_checkpoint
from trl import GRPOConfig, GRPOTrainer

from liger_patch import LigerPatchCallback


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="hub name or local path (default: tiny random Llama)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--beta", type=float, default=0.04, help="KL coefficient (0: no reference model)")
    parser.add_argument("--output-dir", default="out/trl_grpo")
    args = parser.parse_args(argv)

    model = args.model or tiny_checkpoint(str(Path(args.output_dir) / "tiny"))
    config = GRPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16 if args.model is None else 128,
        temperature=0.9,
        beta=args.beta,
        max_steps=args.steps,
        logging_steps=max(1, args.steps // 10),
        learning_rate=1e-6 if args.model else 1e-3,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=arithmetic_prompts(256),
        callbacks=[LigerPatchCallback()],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in (logged[0], logged[-1]):
        kl = f"  kl {entry['kl']:.4f}" if "kl" in entry else ""
        print(
            f"step {entry['step']}: loss {entry['loss']:.4f}  reward {entry['reward']:.4f}  "
            f"entropy {entry['entropy']:.3f}{kl}"
        )


if __name__ == "__main__":
    main()
