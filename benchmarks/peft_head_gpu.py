"""LoRA on every linear layer including ``lm_head``: patched against unpatched step time and peak.

A Llama-3.2-1B-shaped model (random init, bf16), PEFT LoRA (r=16, alpha=32, dropout 0.05) on
q/k/v/o, the MLP and ``lm_head``, AdamW over the adapters, 8x2048 tokens with the first quarter of
each sequence ignored. One process alternates segments of ``--segment-steps`` steps: unpatched,
patched (``apply_liger_to`` on the PEFT model), ... with learning rate 0 and the same batch, so
every step of every segment computes the same loss (parity: patched against unpatched within
``LOSS_TOL``) and the fused path must have run. Reports the median step (each segment's first
left out) and the peak allocated memory of each variant.

    python benchmarks/peft_head_gpu.py --out docs/results/peft_head_gpu.json
    python benchmarks/peft_head_gpu.py --smoke   # a tiny Llama on the CPU: a check of the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from common import LLAMA_3_2_1B, environment, need_cuda, write_json

LOSS_TOL = 2e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


SMOKE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


def build(batch: int, seq: int, smoke: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    shape = SMOKE if smoke else LLAMA_3_2_1B
    config = LlamaConfig(**{**shape, "tie_word_embeddings": False}, attn_implementation="sdpa")
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
    model = get_peft_model(model, lora)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    labels = ids.clone()
    labels[:, : seq // 4] = -100
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=0.0), {"input_ids": ids, "labels": labels}


def segment(model, opt, batch: dict, steps: int) -> dict:
    cuda = batch["input_ids"].is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        torch.manual_seed(1)  # the same dropout masks in every step of every segment
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return {"ms": times, "losses": losses, "peak_gib": peak}


def main() -> int:
    import liger_patch as lp
    from liger_patch.patching.state import patch_state

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--segment-steps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if not args.smoke and not need_cuda(__file__):
        return 2
    model, opt, batch = build(2, 64, True) if args.smoke else build(8, 2048, False)
    segment(model, opt, batch, 2)  # warm-up
    runs = {"unpatched": [], "patched": []}
    fused = []
    for _ in range(args.rounds):
        runs["unpatched"].append(segment(model, opt, batch, args.segment_steps))
        lp.apply_liger_to(model)
        runs["patched"].append(segment(model, opt, batch, args.segment_steps))
        fused.append(bool(patch_state(model).fused_ran))
        lp.revert_liger(model)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    out = {"environment": environment(), "device": device, "lora_targets": TARGETS}
    for name, segs in runs.items():
        out[f"{name}_step_ms"] = statistics.median(t for s in segs for t in s["ms"][1:])
        out[f"{name}_peak_gib"] = max(s["peak_gib"] for s in segs)
        out[f"{name}_losses"] = [s["losses"] for s in segs]
    diff = max(
        abs(a - b)
        for u, p in zip(runs["unpatched"], runs["patched"], strict=True)
        for a, b in zip(u["losses"], p["losses"], strict=True)
    )
    out["max_loss_diff"] = diff
    out["fused_ran"] = all(fused)
    out["parity_ok"] = diff <= LOSS_TOL and all(fused)
    out["patched_over_unpatched"] = out["patched_step_ms"] / out["unpatched_step_ms"]
    print(json.dumps({k: v for k, v in out.items() if not k.endswith("losses")}), flush=True)
    if args.out:
        write_json(args.out, out)
    return 0 if out["parity_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
