"""TRL's DistillationTrainer or GKDTrainer, unmodified, with the fused distillation loss (needs trl).

    python examples/trl_distillation.py                    # DistillationTrainer, tiny Llamas, offline
    python examples/trl_distillation.py --trainer gkd      # GKDTrainer (trl.experimental.gkd)
    python examples/trl_distillation.py --model Qwen/Qwen2.5-0.5B-Instruct \
        --teacher Qwen/Qwen2.5-1.5B-Instruct                # hub checkpoints, one vocabulary

One line: ``callbacks=[LigerPatchCallback()]``. The student's and the teacher's hidden states and
heads then go to ``fused_linear_distillation`` instead of the trainer's own divergence: the same
generalized JSD (``beta``), temperature, masking and reduction, the same logged ``loss`` (and
DistillationTrainer's ``entropy``), without either model's ``tokens x vocab`` logits. If a step
ever runs TRL's own divergence instead, a ``LigerBypassWarning`` says why.

The default models are built from configs (a student of hidden size 64 and a teacher of 96, one
vocabulary of 1000) with a byte-level tokenizer from ``tiny_trl.py``, so nothing is downloaded;
bf16 is used only where the GPU supports it.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from tiny_trl import arithmetic_chats, arithmetic_prompts, tiny_model, tiny_tokenizer

from liger_patch import LigerPatchCallback


def trainer_for(args: argparse.Namespace, student, teacher, tokenizer):
    """The trainer ``args.trainer`` names, with the callback and a small run's settings."""
    common = dict(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        max_steps=args.steps,
        logging_steps=1,
        learning_rate=2e-5 if args.model else 1e-3,
        beta=0.5,
        temperature=0.9,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        save_strategy="no",
        report_to=[],
    )
    if args.trainer == "gkd":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # trl.experimental announces itself
            from trl.experimental.gkd import GKDConfig, GKDTrainer
        config = GKDConfig(lmbda=0.5, max_new_tokens=16, **common)  # half the batches: the student's own
        trainer_class, dataset = GKDTrainer, arithmetic_chats(256)
    else:
        from trl import DistillationConfig, DistillationTrainer

        config = DistillationConfig(max_completion_length=16, **common)  # on-policy: it generates
        trainer_class, dataset = DistillationTrainer, arithmetic_prompts(256)
    return trainer_class(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[LigerPatchCallback()],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", choices=("distillation", "gkd"), default="distillation")
    parser.add_argument("--model", default=None, help="student: hub name or local path (default: tiny Llama)")
    parser.add_argument("--teacher", default=None, help="teacher with the student's vocabulary")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--output-dir", default="out/trl_distillation")
    args = parser.parse_args(argv)
    if (args.model is None) != (args.teacher is None):
        parser.error("give both --model and --teacher, or neither")

    student = args.model or tiny_model(seed=0)
    teacher = args.teacher or tiny_model(hidden_size=96, seed=1)
    if args.model:  # a hub model brings its own tokenizer; both trainers pad prompts on the left
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    else:
        tokenizer = tiny_tokenizer()
    trainer = trainer_for(args, student, teacher, tokenizer)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in (logged[0], logged[-1]):
        entropy = f"  entropy {entry['entropy']:.3f}" if "entropy" in entry else ""
        print(f"step {entry['step']}: loss {entry['loss']:.4f}{entropy}")


if __name__ == "__main__":
    main()
