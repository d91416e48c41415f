"""End to end through TRL's ``GKDTrainer`` or ``DistillationTrainer``: distillation training
steps, unpatched vs patched.

``--trainer gkd`` (default): offline GKD (``lmbda=0``: the dataset's completions, no generation,
so the step is the two models' forwards, the divergence and the student's backward).
``--trainer distillation``: TRL's ``DistillationTrainer``, on-policy: each step the student
generates ``seq`` tokens per prompt (random weights rarely stop early), then the divergence
(unpatched: TRL's own chunked kernel, fp32 logits tiles; patched: our op with fp32 logits).
bf16 random-init Llama models: a
Llama-3.2-1B-shaped student and a teacher of hidden size 3072 (28 layers, Llama-3.2-3B's shape),
one vocabulary of 128256, ``batch`` conversations of about ``seq`` byte tokens each (assistant
turns of random letters; the byte-level tokenizer of ``examples/tiny_trl.py``). Variants, each in
its own process:

* ``unpatched``: TRL as it ships (GKD: both models' full logits, then ``generalized_jsd_loss``);
* ``liger_patch``: ``callbacks=[LigerPatchCallback()]``: the fused distillation op, neither
  ``tokens x vocab`` logits built.

Reported per variant: median optimizer-step time (``e2e_trl.StepClock``), peak memory allocated
over the timed steps, and the first step's logged loss (same seed, init and data for both).

    python benchmarks/e2e_distill.py --out docs/results/e2e_distill.json
    python benchmarks/e2e_distill.py --trainer distillation --seq 256 \\
        --out docs/results/e2e_distill_trainer.json
    python benchmarks/e2e_distill.py --smoke      # tiny models on the CPU: checks the script
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import warnings

from common import LLAMA_3_2_1B, report_runs, run_in_processes
from e2e_trl import step_table, timed_callbacks, training_settings

VARIANTS = ("unpatched", "liger_patch")
TEACHER = dict(LLAMA_3_2_1B, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, head_dim=128)


def build_models(smoke: bool):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if smoke:
        from tiny_trl import tiny_model

        return tiny_model(seed=0), tiny_model(hidden_size=96, seed=1)
    models = []
    for seed, shape in ((0, LLAMA_3_2_1B), (1, TEACHER)):
        torch.manual_seed(seed)
        config = LlamaConfig(**dict(shape, tie_word_embeddings=False), pad_token_id=0, eos_token_id=2)
        with torch.device("cuda"):  # initialise on the GPU: CPU init of billions of parameters is slow
            models.append(
                AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
            )
    return tuple(models)


def chats(n: int, length: int):
    """``n`` conversations: a short user turn and an assistant turn of ``length`` random letters."""
    from datasets import Dataset

    rng = random.Random(1)
    rows = []
    for i in range(n):
        reply = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))
        rows.append(
            {"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": reply}]}
        )
    return Dataset.from_list(rows)


def _trainer_parts(trainer: str, batch: int, seq: int, n: int):
    """The trainer class, its config's own settings and its dataset."""
    if trainer == "distillation":
        from tiny_trl import arithmetic_prompts
        from trl import DistillationConfig, DistillationTrainer

        return DistillationTrainer, DistillationConfig, dict(max_completion_length=seq), arithmetic_prompts(n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # trl.experimental announces itself
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    return GKDTrainer, GKDConfig, dict(lmbda=0.0, max_length=seq + 32), chats(n, seq)


def run_one(
    variant: str, trainer_name: str, warmup: int, steps: int, batch: int, seq: int, smoke: bool, out_dir: str
) -> dict:
    from tiny_trl import tiny_tokenizer

    trainer_class, config_class, own, dataset = _trainer_parts(
        trainer_name, batch, seq, (warmup + steps) * batch
    )

    student, teacher = build_models(smoke)
    clock, callbacks = timed_callbacks(warmup, smoke, patched=variant == "liger_patch")
    config = config_class(
        **training_settings(out_dir, batch, warmup + steps, smoke), beta=0.5, temperature=1.0, **own
    )
    trainer = trainer_class(
        model=student,
        teacher_model=teacher,
        args=config,
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
        callbacks=callbacks,
    )
    op_calls = _count_op_calls()
    trainer.train()
    first = next(e for e in trainer.state.log_history if "loss" in e)
    return {
        "variant": variant,
        **clock.result(),
        "op_calls": len(op_calls),  # one per micro-batch when patched, none unpatched
        "first_loss": first["loss"],
        "gradient_checkpointing": config.gradient_checkpointing,
    }


def _count_op_calls() -> list:
    """Calls of the registered distillation operator from now on (proof the patch computed the loss)."""
    from liger_patch.ops.distillation import operator

    calls, op = [], operator.FUSED_DISTILL

    def counted(*args):
        calls.append(1)
        return op(*args)

    operator.FUSED_DISTILL = counted
    return calls


def table(results: list[dict]) -> str:
    columns = {"first loss": lambda r: f"{r['first_loss']:.6f}", "op calls": lambda r: f"{r['op_calls']}"}
    return "\n".join(step_table(results, "unpatched", "unpatched", columns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainer", choices=("gkd", "distillation"), default="gkd")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024, help="assistant turn length, in byte tokens")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, 1 + 1 steps")
    parser.add_argument("--one", metavar="VARIANT", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="out/e2e_distill")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps, args.batch, args.seq = 1, 1, 2, 24
    if args.one:
        result = run_one(
            args.one, args.trainer, args.warmup, args.steps, args.batch, args.seq, args.smoke, args.workdir
        )
        print(json.dumps(result))
        return 0
    shared = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--batch", str(args.batch)]
    shared += ["--seq", str(args.seq), "--workdir", args.workdir, "--trainer", args.trainer]
    runs = [{"variant": variant} for variant in args.variants.split(",")]
    results = run_in_processes(__file__, runs, shared + (["--smoke"] if args.smoke else []))
    report_runs(results, table(results), args.out, ("transformers", "trl"), batch=args.batch, seq=args.seq)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
