"""End to end: one AdamW step of a random-init model in bf16 (sdpa), unpatched vs patched; one
row keeps fp32 parameters and runs the forward under ``torch.autocast(bf16)`` (AMP).

Each (model, tokens, variant) runs in its own process so that patches and allocator state do
not leak between variants. Rows: Llama-3.2-1B and Qwen2.5-0.5B shapes, and a Qwen2.5-7B shape
with gradient checkpointing. Variants: ``unpatched``, ``liger_kernel`` (liger-kernel's fused linear
cross-entropy patch only: rope, rms_norm, swiglu and its plain cross-entropy off) when it is
importable, ``liger_patch`` (ours) and ``liger_patch_lean`` (ours, ``memory_budget="lean"``); by
``--variants`` only, PyTorch's own heads on the unpatched model: ``torch_compile`` and
``torch_linear_ce`` run the decoder as is, then ``benchmarks/flce.py``'s loss of that name (the
``torch.compile``d eager loss; PyTorch's chunked ``F.linear_cross_entropy``, whose row carries the
reason where the installed torch lacks it and ``TORCH_LCE_SOURCE`` is unset) on the flat hidden
states, the head's weight and the labels shifted as HF's ``ForCausalLMLoss`` shifts them (inside
the forward's autocast in the AMP rows). Reported: median step time over the timed steps, peak
memory allocated in the steady state, and the first step's loss (same seed and init for all).

    python benchmarks/e2e.py --out docs/results/e2e.json
    python benchmarks/e2e.py --variants unpatched,liger_kernel,liger_patch,liger_kernel,liger_patch --steps 8
    python benchmarks/e2e.py --ignore-frac 0.25 --out docs/results/e2e_sft.json   # prompts masked
    python benchmarks/e2e.py --variants unpatched,torch_compile,torch_linear_ce,liger_patch  # PyTorch heads

A variant named twice runs twice (interleaved A/B). Model shapes and the memory measure come from
``benchmarks/common.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from common import LLAMA_3_2_1B, QWEN2_5_05B, QWEN2_5_7B, GiB, PeakMemory, report_runs, run_in_processes

ROWS = {  # row: (family, config, batch, sequence length, gradient checkpointing, AMP)
    "llama1b_8x2048": ("llama", LLAMA_3_2_1B, 8, 2048, False, False),
    "llama1b_16x2048": ("llama", LLAMA_3_2_1B, 16, 2048, False, False),
    "qwen05b_16x2048": ("qwen2", QWEN2_5_05B, 16, 2048, False, False),
    "qwen7b_8x2048_gc": ("qwen2", QWEN2_5_7B, 8, 2048, True, False),
    # fp32 parameters, forward under torch.autocast(bf16): the HF Trainer's bf16=True on an fp32 model
    "llama1b_amp_8x2048": ("llama", LLAMA_3_2_1B, 8, 2048, False, True),
    "qwen05b_amp_8x2048": ("qwen2", QWEN2_5_05B, 8, 2048, False, True),
}
VARIANTS = ("unpatched", "liger_kernel", "liger_patch", "liger_patch_lean")
PEER_HEADS = ("torch_compile", "torch_linear_ce")  # head + loss: flce.py's function of that name


def make_config(family: str, config: dict):
    from transformers import LlamaConfig, Qwen2Config

    return (LlamaConfig if family == "llama" else Qwen2Config)(**config)


def build(row: str, variant: str):
    """The row's random-init bf16 model with the variant's patch, its AdamW, and one batch of ids."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoModelForCausalLM

    family, config_dict, batch, seq, checkpointing, amp = ROWS[row]
    if variant == "liger_kernel":
        from liger_kernel import transformers as lk

        patch = lk.apply_liger_kernel_to_llama if family == "llama" else lk.apply_liger_kernel_to_qwen2
        patch(rope=False, rms_norm=False, swiglu=False, cross_entropy=False, fused_linear_cross_entropy=True)
    torch.manual_seed(0)
    config = make_config(family, config_dict)
    # The model's modules imported here, not under the device context below: imported there,
    # torchaudio's kaldi module (which transformers' audio utilities import) makes its module-level
    # eps tensor on the GPU, 4 bytes that stay allocated through every step of the variants that
    # import transformers' modeling code no earlier (liger-kernel's patch imports it beforehand).
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with torch.device("cuda"):  # initialise on the GPU: CPU init of 1B parameters takes longer than the run
        dtype = torch.float32 if amp else torch.bfloat16
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if variant.startswith("liger_patch"):
        import liger_patch

        liger_patch.apply_liger_to(model, memory_budget="lean" if variant.endswith("lean") else None)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda", generator=gen)
    return model, opt, ids


def make_labels(ids, ignore_frac: float):
    """The batch's labels: ``ids`` themselves, with the first ``ignore_frac`` of every sequence
    set to -100 (an SFT batch whose prompts are masked)."""
    labels = ids.clone()
    labels[:, : round(ids.shape[1] * ignore_frac)] = -100
    return labels


def peer_head(variant: str):
    """The loss function of (flat hidden states, head weight, flat labels) that replaces the HF
    head + loss for the variant: ``flce.py``'s function of its name for ``PEER_HEADS``, else
    ``None`` (the model's own forward)."""
    if variant not in PEER_HEADS:
        return None
    import flce

    return getattr(flce, variant)


def shift_labels(labels):
    """HF's ``ForCausalLMLoss`` shift: position t is scored on label t + 1, the last one on -100."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=-100)[..., 1:]


def split_head_loss(head, model, ids, labels):
    """The causal LM loss with the decoder run as is and the head + loss done by ``head`` on the
    flat hidden states, the head's weight and the shifted labels: HF's own loss when ``head``
    computes the fp32 cross-entropy of ``hidden @ weight.T``, mean over the kept labels."""
    hidden = model.model(input_ids=ids).last_hidden_state
    return head(hidden.flatten(0, -2), model.lm_head.weight, shift_labels(labels).flatten())


def train_step(model, opt, ids, amp: bool, labels=None, head=None):
    """One optimizer step on ``ids`` (their own labels unless ``labels`` are given), the forward
    (with the ``head`` of ``split_head_loss`` when given) under bf16 autocast for ``amp``; returns
    the loss, detached."""
    import torch

    labels = ids if labels is None else labels
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        if head is None:
            loss = model(input_ids=ids, labels=labels).loss
        else:
            loss = split_head_loss(head, model, ids, labels)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_one(row: str, variant: str, warmup: int, steps: int, ignore_frac: float = 0.0) -> dict:
    import torch

    model, opt, ids = build(row, variant)
    labels = make_labels(ids, ignore_frac)
    head = peer_head(variant)

    def step():
        return train_step(model, opt, ids, amp=ROWS[row][5], labels=labels, head=head)

    first_loss = float(step())
    for _ in range(warmup - 1):
        step()
    times = []
    with PeakMemory() as mem:  # the steady state's peak
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return {
        "row": row,
        "variant": variant,
        "ms": statistics.median(times),
        "ms_all": times,
        "peak_gib": mem.peak / GiB,
        "peak_requested_gib": mem.peak_requested / GiB,
        "first_loss": first_loss,
        "ignore_frac": ignore_frac,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("ROW", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--ignore-frac", type=float, default=0.0, help="share of every sequence's first labels set to -100"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.warmup, args.steps, args.ignore_frac)))
        return 0

    runs = [{"row": row, "variant": v} for row in args.rows.split(",") for v in args.variants.split(",")]
    shared = ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    results = run_in_processes(
        __file__, runs, shared + ["--ignore-frac", str(args.ignore_frac)], echo_stderr=False
    )

    lines = [
        "| model, tokens | " + " | ".join(args.variants.split(",")) + " |",
        "|---" * (1 + len(args.variants.split(","))) + "|",
    ]
    for row in args.rows.split(","):
        cells = []
        base = next(
            (r for r in results if r["row"] == row and r["variant"] == "unpatched" and "ms" in r), None
        )
        for r in (r for r in results if r["row"] == row):  # in run order: a repeated variant, each run
            if "ms" not in r:
                cells.append("error")
                continue
            dloss = f", loss diff {abs(r['first_loss'] - base['first_loss']):.1e}" if base else ""
            cells.append(f"{r['ms']:.0f} ms, {r['peak_gib']:.1f} GiB{dloss}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    report_runs(results, "\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
