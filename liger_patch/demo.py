"""``python -m liger_patch demo``: train a tiny Llama unpatched and patched, side by side.

The model is built from a config (no downloads) and both runs start from the same weights and
see the same batches, so the loss columns should agree to float rounding while the patched run
never builds the ``tokens x vocab`` logits. On a GPU the peak-memory row shows what that saves.
Finishes in well under 30 s on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch

__all__ = ["main"]


@dataclass
class RunResult:
    losses: list[float]
    seconds_per_step: float
    peak_mib: float | None


def _build_model(device: torch.device, dtype: torch.dtype, vocab: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).train()


def _batches(steps: int, batch: int, seq: int, vocab: int, device: torch.device) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 4] = -100  # an ignored "prompt", as in supervised fine-tuning
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


def _train(model, batches: list[dict], device: torch.device) -> RunResult:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    on_cuda = device.type == "cuda"
    losses = []
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = None
    for step, batch in enumerate(batches):
        if step == 1:  # the first step warms up kernels and allocator: leave it out of the timing
            if on_cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    if on_cuda:
        torch.cuda.synchronize()
    timed_steps = max(len(batches) - 1, 1)
    seconds = (time.perf_counter() - start) / timed_steps if start is not None else float("nan")
    peak = torch.cuda.max_memory_allocated() / 2**20 if on_cuda else None
    return RunResult(losses, seconds, peak)


def _table(unpatched: RunResult, patched: RunResult) -> str:
    rows = [("step", "HF loss", "liger_patch loss", "|difference|")]
    for i, (a, b) in enumerate(zip(unpatched.losses, patched.losses, strict=True)):
        rows.append((str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}"))
    rows.append(
        (
            "time/step",
            f"{unpatched.seconds_per_step * 1e3:.1f} ms",
            f"{patched.seconds_per_step * 1e3:.1f} ms",
            f"speed x{unpatched.seconds_per_step / patched.seconds_per_step:.2f}",
        )
    )
    if unpatched.peak_mib is not None and patched.peak_mib is not None:
        rows.append(
            (
                "peak memory",
                f"{unpatched.peak_mib:.0f} MiB",
                f"{patched.peak_mib:.0f} MiB",
                f"{unpatched.peak_mib - patched.peak_mib:.0f} MiB saved",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(4)]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="python -m liger_patch demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (default 6)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument(
        "--vocab", type=int, default=None, help="vocabulary size (default: 32000 GPU, 8192 CPU)"
    )
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 1024 GPU, 256 CPU)")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)

    import liger_patch as lp

    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    vocab = args.vocab or (32000 if on_cuda else 8192)
    seq = args.seq or (1024 if on_cuda else 256)
    hidden = 256 if on_cuda else 128

    unpatched_model = _build_model(device, dtype, vocab, hidden)
    patched_model = lp.apply_liger_to(copy.deepcopy(unpatched_model))
    batches = _batches(args.steps, args.batch, seq, vocab, device)

    print(
        f"tiny Llama (2 layers, hidden {hidden}, vocab {vocab}), batch {args.batch} x {seq} tokens, "
        f"{args.steps} AdamW steps, {device.type} {str(dtype).replace('torch.', '')}"
    )
    unpatched = _train(unpatched_model, batches, device)
    if on_cuda:
        torch.cuda.empty_cache()
    patched = _train(patched_model, batches, device)
    print(_table(unpatched, patched))
    worst = max(abs(a - b) for a, b in zip(unpatched.losses, patched.losses, strict=True))
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-3
    print(f"max |loss difference| {worst:.2e} ({'OK' if worst <= tolerance else 'TOO LARGE'})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
