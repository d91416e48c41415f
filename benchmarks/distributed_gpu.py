"""Two-GPU check of the fused loss under FSDP2 and DDP: bf16 parity and peak memory per rank.

Launch (one node, 2 GPUs, nccl):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/distributed_gpu.py \
        --out docs/results/distributed_gpu.json

Part 1, parity (tiny Llama, vocab 4096, hidden 256, 2 layers, 5 AdamW steps, bf16): for each
wrapping -- FSDP2 with lm_head as its own unit, FSDP2 with tied embeddings in the root unit
(both ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), DDP under bf16 autocast --
train unpatched, patched, and an fp32 unpatched reference. Report the per-step losses, the
step-0 gradients (relative L2 error per parameter, worst parameter) and the final parameters.

Part 2, memory (Llama-3.2-1B shape: vocab 128256, hidden 2048, 16 layers, intermediate 8192,
32 heads, 8 kv heads, tied embeddings, sdpa; random init): FSDP2 (each decoder layer a unit,
root holds embeddings + head), bf16 mixed precision, AdamW, 8 x 2048 tokens per rank, patched
and unpatched, without and with activation checkpointing. Report peak allocated / reserved
memory per rank during the training steps and the median step time.
The two variants run in ``--rounds`` rounds, the order alternating (``common.alternating_rounds``):
peaks and losses are the first round's, the step time the median over rounds, and the patched
record's ``paired_ratio`` the median over rounds of patched / unpatched in the same round.

``--smoke`` runs the same code on CPU with gloo and tiny shapes (no memory figures): a check
that the script itself works, for machines without GPUs.
Exit status 1 when a parity check fails (after everything has run and the JSON is written).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import liger_patch as lp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GRAD_TOL,
    LLAMA_3_2_1B,
    LOSS_TOL,
    alternating_rounds,
    batch_for,
    full,
    log,
    max_abs_diff,
    training_steps,
    worst_relative_error,
    write_json,
)

TINY = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)
SMOKE_TINY = dict(TINY, vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16)
LLAMA_1B = LLAMA_3_2_1B
SMOKE_1B = dict(LLAMA_1B, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip


def build_llama(shape: dict, device: torch.device, tied: bool, seed: int = 0) -> nn.Module:
    """Random-init LlamaForCausalLM in fp32 on ``device``; identical on every rank (same seed)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{**shape, "tie_word_embeddings": tied})
    torch.manual_seed(seed)
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=torch.float32).train()


def shard_fsdp2(model: nn.Module, head_unit: bool, mp: MixedPrecisionPolicy | None) -> nn.Module:
    """Each decoder layer a unit; lm_head its own unit when ``head_unit``; then the root."""
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    if head_unit:
        fully_shard(model.lm_head, **kwargs)
    fully_shard(model, **kwargs)
    return model


# --------------------------------------------------------------------------------------------
# Part 1: parity
# --------------------------------------------------------------------------------------------


def parity_run(wrapping: str, patched: bool, bf16: bool, device: torch.device, steps: int) -> dict:
    shape = TINY if device.type == "cuda" else SMOKE_TINY
    model = build_llama(shape, device, tied=wrapping == "fsdp2_tied_root")
    if patched:
        lp.apply_liger_to(model)
    autocast = contextlib.nullcontext()
    if wrapping == "ddp_autocast":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if bf16:
            autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        wrapped = shard_fsdp2(model, head_unit=wrapping == "fsdp2_head_unit", mp=mp)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, weight_decay=0.0)
    losses, grads0 = [], {}
    for step in range(steps):
        batch = batch_for(
            step, dist.get_rank(), shape["vocab_size"], 4, 128 if device.type == "cuda" else 32, device
        )
        with autocast:
            out = wrapped(**batch)
        out.loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = out.loss.detach().float().reshape(1)
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads0": grads0, "params": params, "logits_none": out.logits is None}


def parity(device: torch.device, steps: int) -> tuple[dict, bool]:
    report, ok = {}, True
    for wrapping in ("fsdp2_head_unit", "fsdp2_tied_root", "ddp_autocast"):
        ref = parity_run(wrapping, patched=False, bf16=False, device=device, steps=steps)
        plain = parity_run(wrapping, patched=False, bf16=True, device=device, steps=steps)
        fused = parity_run(wrapping, patched=True, bf16=True, device=device, steps=steps)
        grad_pu, grad_pu_name = worst_relative_error(fused["grads0"], plain["grads0"])
        grad_pf, _ = worst_relative_error(fused["grads0"], ref["grads0"])
        grad_uf, _ = worst_relative_error(plain["grads0"], ref["grads0"])
        param_pu, _ = worst_relative_error(fused["params"], plain["params"])
        loss_pu = max_abs_diff(fused["losses"], plain["losses"])
        passed = loss_pu <= LOSS_TOL and grad_pu <= GRAD_TOL and fused["logits_none"]
        ok &= passed
        report[wrapping] = {
            "losses_patched": fused["losses"],
            "losses_unpatched": plain["losses"],
            "losses_fp32_reference": ref["losses"],
            "max_loss_diff_patched_vs_unpatched": loss_pu,
            "max_loss_diff_patched_vs_fp32": max_abs_diff(fused["losses"], ref["losses"]),
            "max_loss_diff_unpatched_vs_fp32": max_abs_diff(plain["losses"], ref["losses"]),
            "step0_grad_rel_err_patched_vs_unpatched": grad_pu,
            "step0_grad_rel_err_worst_param": grad_pu_name,
            "step0_grad_rel_err_patched_vs_fp32": grad_pf,
            "step0_grad_rel_err_unpatched_vs_fp32": grad_uf,
            "final_param_rel_err_patched_vs_unpatched": param_pu,
            "fused_path_ran": fused["logits_none"],
            "passed": passed,
        }
    return report, ok


# --------------------------------------------------------------------------------------------
# Part 2: memory
# --------------------------------------------------------------------------------------------


def memory_run(shape: dict, patched: bool, checkpointing: bool, device: torch.device, args) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = build_llama(shape, device, tied=shape["tie_word_embeddings"])
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if patched:
        lp.apply_liger_to(model)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_fsdp2(model, head_unit=False, mp=mp)
    result = {"patched": patched, "activation_checkpointing": checkpointing}
    result.update(training_steps(model, shape["vocab_size"], dist.get_rank(), device, args))
    del model
    return result


def memory(device: torch.device, args) -> list[dict]:
    shape = SMOKE_1B if args.smoke else LLAMA_1B
    rows = []
    for checkpointing in (False, True):

        def run(patched: bool, checkpointing: bool = checkpointing) -> dict:
            result = memory_run(shape, patched, checkpointing, device, args)
            log(f"  memory run done: patched={patched} checkpointing={checkpointing}")
            return result

        rows += alternating_rounds(run, args.rounds)
    return rows


# --------------------------------------------------------------------------------------------


def print_tables(parity_report: dict, memory_rows: list[dict]) -> None:
    log("\nbf16 parity, patched vs unpatched (tiny Llama, 2 ranks)")
    log(f"{'wrapping':<18} {'max |dloss|':>12} {'grad0 rel err':>14} {'vs fp32: patched':>17} "
        f"{'unpatched':>10} {'pass':>5}")  # fmt: skip
    for name, r in parity_report.items():
        log(
            f"{name:<18} {r['max_loss_diff_patched_vs_unpatched']:>12.2e} "
            f"{r['step0_grad_rel_err_patched_vs_unpatched']:>14.2e} "
            f"{r['step0_grad_rel_err_patched_vs_fp32']:>17.2e} "
            f"{r['step0_grad_rel_err_unpatched_vs_fp32']:>10.2e} "
            f"{'yes' if r['passed'] else 'NO':>5}"
        )
    log("\nFSDP2, Llama-3.2-1B shape, bf16 mixed precision, AdamW, peak memory per rank")
    log(f"{'act. ckpt':<10} {'variant':<10} {'peak alloc GiB':>15} {'peak reserved GiB':>18} "
        f"{'step s':>8} {'last loss':>10}")  # fmt: skip
    for r in memory_rows:
        alloc, reserved = (r.get(k) for k in ("peak_allocated_gib", "peak_reserved_gib"))
        alloc = "n/a" if alloc is None else f"{alloc:.2f}"
        reserved = "n/a" if reserved is None else f"{reserved:.2f}"
        log(
            f"{'yes' if r['activation_checkpointing'] else 'no':<10} "
            f"{'patched' if r['patched'] else 'unpatched':<10} "
            f"{alloc:>15} {reserved:>18} "
            f"{r['median_step_s']:>8.3f} {r['losses'][-1]:>10.4f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results (written by rank 0)")
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--mem-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="memory runs of each variant, alternating")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo + tiny shapes: check the script")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.smoke:
        device, backend, options = torch.device("cpu"), "gloo", {}
    else:
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
        options = {"device_id": device}
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference is IEEE fp32
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10), **options)
    warnings.filterwarnings("ignore", message=".*liger_patch.*")

    import transformers

    log(f"torch {torch.__version__}, transformers {transformers.__version__}, world {dist.get_world_size()}, "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")  # fmt: skip
    log("part 1: bf16 parity")
    parity_report, parity_ok = parity(device, args.parity_steps)
    memory_rows = []
    if not args.skip_memory:
        log("part 2: memory")
        memory_rows = memory(device, args)
    if dist.get_rank() == 0:
        results = {
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "liger_patch": lp.__version__,
            },
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "world_size": dist.get_world_size(),
            "tokens_per_rank": args.batch * args.seq,
            "tolerances": {"loss_abs": LOSS_TOL, "grad_rel": GRAD_TOL},
            "parity": parity_report,
            "parity_passed": parity_ok,
            "memory_fsdp2_llama_3_2_1b_shape": memory_rows,
        }
        write_json(args.out, results, indent=2)
    print_tables(parity_report, memory_rows)
    log(f"\nwrote {args.out}; parity {'passed' if parity_ok else 'FAILED'}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
