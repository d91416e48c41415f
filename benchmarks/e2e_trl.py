"""End to end through TRL: ``SFTTrainer`` steps at a Qwen2.5-0.5B shape, bf16, 8 x 2048 tokens.

Each variant trains the same random-init model (bf16 weights, ``bf16=True``, TRL's defaults
otherwise: gradient checkpointing on, fused AdamW) on the same pre-tokenized rows of 2048 random
ids, every token trained, in its own process:

* ``trl``: TRL as it ships (1.15+: its own chunked fused head, ``fused_lm_head=True``);
* ``trl_liger_kernel``: ``use_liger_kernel=True`` (TRL keeps its fused head and takes only
  liger-kernel's layer kernels: rope, RMSNorm, SwiGLU);
* ``liger_patch``: ``callbacks=[LigerPatchCallback()]`` (our op computes TRL's fused head);
* ``liger_patch_liger_kernel``: both.

Reported per variant: median optimizer-step time (CUDA events around each step, from the
callback hooks) over the timed steps, the peak memory allocated over them, and the first
step's logged loss, token accuracy and entropy (same seed, init and data for all).

    python benchmarks/e2e_trl.py --out docs/results/e2e_trl.json
    python benchmarks/e2e_trl.py --variants trl,liger_patch,trl,liger_patch   # interleaved A/B
    python benchmarks/e2e_trl.py --rounds 3 --out docs/results/e2e_trl.json  # every variant 3 times
    python benchmarks/e2e_trl.py --smoke      # tiny model, CPU, trl and liger_patch: checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from common import QWEN2_5_05B, GiB, report_runs, run_in_processes

VARIANTS = ("trl", "trl_liger_kernel", "liger_patch", "liger_patch_liger_kernel")
BATCH, SEQ = 8, 2048
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


class StepClock:
    """A TrainerCallback that times each optimizer step with CUDA events and measures the peak
    memory allocated from the first timed step on."""

    def __init__(self, warmup: int, cuda: bool):
        from transformers import TrainerCallback

        self.warmup, self.cuda, self.events, self.peak = warmup, cuda, [], 0
        clock = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                clock.begin(state.global_step)

            def on_step_end(self, args, state, control, **kw):
                clock.end(state.global_step)

        self.callback = _Callback()

    def begin(self, step: int) -> None:
        import torch

        if not self.cuda or step < self.warmup:
            return
        if step == self.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.events.append([start, None])

    def end(self, step: int) -> None:
        import torch

        if self.cuda and self.events and self.events[-1][1] is None:
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self.events[-1][1] = stop

    def result(self) -> dict:
        import torch

        if not self.cuda:
            return {"ms": None, "ms_all": [], "peak_gib": None}
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in self.events]
        return {
            "ms": statistics.median(times),
            "ms_all": times,
            "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        }


def timed_callbacks(warmup: int, smoke: bool, patched: bool) -> tuple[StepClock, list]:
    """A ``StepClock`` (timing only on CUDA, not in ``smoke`` runs) and the trainer's callbacks:
    the clock's, then ``LigerPatchCallback`` when ``patched``."""
    clock = StepClock(warmup, cuda=not smoke)
    callbacks = [clock.callback]
    if patched:
        from liger_patch import LigerPatchCallback

        callbacks.append(LigerPatchCallback())
    return clock, callbacks


def training_settings(out_dir: str, batch: int, max_steps: int, smoke: bool) -> dict:
    """The training arguments the TRL benchmarks share: ``max_steps`` steps of ``batch`` rows at a
    learning rate of 1e-5, every step logged, bf16 (``smoke``: fp32 on the CPU), fixed seeds,
    nothing saved or reported."""
    return dict(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        max_steps=max_steps,
        learning_rate=1e-5,
        logging_steps=1,
        bf16=not smoke,
        use_cpu=smoke,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )


def build_model(smoke: bool):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    if smoke:
        from tiny_trl import tiny_model

        return tiny_model(seed=0)
    with torch.device("cuda"):  # initialise on the GPU: CPU init of 0.5B parameters is slow
        return AutoModelForCausalLM.from_config(
            Qwen2Config(**QWEN2_5_05B), dtype=torch.bfloat16, attn_implementation="sdpa"
        )


def run_one(variant: str, warmup: int, steps: int, smoke: bool, out_dir: str) -> dict:
    import torch
    from datasets import Dataset
    from tiny_trl import tiny_tokenizer
    from trl import SFTConfig, SFTTrainer

    model = build_model(smoke)
    vocab = model.config.vocab_size
    batch, seq = (2, 32) if smoke else (BATCH, SEQ)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, ((warmup + steps) * batch, seq), generator=gen)
    clock, callbacks = timed_callbacks(warmup, smoke, patched=variant.startswith("liger_patch"))
    config = SFTConfig(
        **training_settings(out_dir, batch, warmup + steps, smoke),
        max_length=seq,
        use_liger_kernel=variant.endswith("liger_kernel"),
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict({"input_ids": ids.tolist()}),
        processing_class=tiny_tokenizer(),  # pad id only: the rows are already token ids
        callbacks=callbacks,
    )
    trainer.train()
    first = next(e for e in trainer.state.log_history if "loss" in e)
    return {
        "variant": variant,
        **clock.result(),
        "first_loss": first["loss"],
        "first_accuracy": first.get("mean_token_accuracy"),
        "first_entropy": first.get("entropy"),
        "gradient_checkpointing": config.gradient_checkpointing,
        "optim": str(config.optim),
    }


def step_table(results: list[dict], base: str, base_label: str, columns: dict[str, Callable]) -> list[str]:
    """Markdown lines, a row per run of ``StepClock`` results: variant, median step ms, its ratio to
    the first timed run of the ``base`` variant (``vs <base_label>``), peak GiB ("n/a" off CUDA),
    then ``columns`` (header: the cell of a result); a failed run's row gives its error."""
    base_run = next((r for r in results if r["variant"] == base and r.get("ms")), None)
    head = ["variant", "step ms (median)", f"vs {base_label}", "peak GiB", *columns]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | error: {r['error']} |" + " |" * (len(head) - 2))
            continue
        ratio = f"{r['ms'] / base_run['ms']:.3f}x" if base_run and r["ms"] else ""
        ms = f"{r['ms']:.1f}" if r["ms"] else "n/a"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] else "n/a"
        cells = [r["variant"], ms, ratio, peak, *(cell(r) for cell in columns.values())]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table(results: list[dict]) -> str:
    columns = {
        "first loss": lambda r: f"{r['first_loss']:.4f}",
        "token accuracy": lambda r: f"{r['first_accuracy']}",
        "entropy": lambda r: f"{r['first_entropy']}",
    }
    return "\n".join(step_table(results, "trl", "TRL", columns) + ["", *summary(results)])


def summary(results: list[dict]) -> list[str]:
    """Per variant, over its runs: the median of the step-time medians, as a ratio to TRL's."""
    runs: dict[str, list[dict]] = {}
    for r in results:
        if r.get("ms"):
            runs.setdefault(r["variant"], []).append(r)
    if "trl" not in runs:
        return []
    base = statistics.median(r["ms"] for r in runs["trl"])
    lines = ["| variant | runs | step ms (median of runs) | vs TRL | peak GiB |", "|---|---|---|---|---|"]
    for variant, rs in runs.items():
        ms = statistics.median(r["ms"] for r in rs)
        peak = max(r["peak_gib"] for r in rs)
        lines.append(f"| {variant} | {len(rs)} | {ms:.1f} | {ms / base:.3f}x | {peak:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--variants", default=None, help=f"default: {','.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=1, help="run the variant list this many times")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, 2 + 2 steps")
    parser.add_argument("--one", metavar="VARIANT", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default="out/e2e_trl")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.smoke:  # liger-kernel's Triton kernels need a GPU
        args.warmup, args.steps = 2, 2
        args.variants = args.variants or "trl,liger_patch"
    args.variants = args.variants or ",".join(VARIANTS)
    if args.one:
        result = run_one(args.one, args.warmup, args.steps, args.smoke, args.workdir)
        print(json.dumps(result))
        return 0

    shared = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--workdir", args.workdir]
    runs = [{"variant": variant} for variant in args.variants.split(",") * args.rounds]
    results = run_in_processes(__file__, runs, shared + (["--smoke"] if args.smoke else []))
    report_runs(results, table(results), args.out, ("transformers", "trl"), batch=BATCH, seq=SEQ)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
