"""Tensor parallelism on GPUs: the fused loss on a vocabulary-sharded lm_head (transformers'
``tp_plan="auto"``) against the unpatched tensor-parallel model, bf16 parity and peak memory per rank.

Launch (one node, 2 GPUs, nccl):

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --nproc_per_node 2 benchmarks/tp_gpu.py \
        --out docs/results/tp_gpu.json

With 4 GPUs, ``--fsdp 2`` runs transformers' 2-D mesh (FSDP2 x tensor parallelism, tp = 2): each
data-parallel replica then trains on its own batches. ``--smoke`` runs the same code on CPU with
gloo and tiny shapes (no memory figures), a check that the script itself works.

Part 1, parity: a tiny Llama (vocab 4098, hidden 256, 2 layers; transformers 5.17 refuses a
vocabulary the tensor-parallel size does not divide, so shards of unequal size are left to the CPU
tests), saved once and loaded on every rank with ``DistributedConfig(tp_plan="auto")``, 5 AdamW steps on
the same batches: unpatched and patched with bf16 weights, and unpatched with fp32 weights as the
reference. Reported: per-step losses, the step-0 gradients (relative L2 error per parameter,
gathered from the shards; the worst parameter) and the final parameters.

Part 2, memory: the Llama-3.2-1B shape (vocab 128256, hidden 2048, 16 layers, tied embeddings,
sdpa; random init, saved in bf16 and loaded sharded), bf16 weights, AdamW, 8 x 2048 tokens per
rank (the same on both ranks of a tensor-parallel group), unpatched and patched, without and
with activation checkpointing. Reported: peak allocated / reserved memory per rank during the
steps, the median step time, the last loss.
The two variants run in ``--rounds`` rounds, the order alternating (``common.alternating_rounds``):
peaks and losses are the first round's, the step time the median over rounds, and the patched
record's ``paired_ratio`` the median over rounds of patched / unpatched in the same round.

Part 3, the op alone: ``vocab_parallel_loss`` (forward + backward, bf16) at N = 16384 tokens,
H = 4096, V = 128256 split over the ranks, against the unsharded op on the whole weight on each
GPU (no communication) and the three-GEMM floor of the shard; median times and extra memory.

Exit status 1 when a parity check fails (after everything has run and the JSON is written).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import liger_patch as lp
from liger_patch.ops.core.vocab_shard import VocabShard
from liger_patch.ops.cross_entropy.vocab_parallel import vocab_parallel_loss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    GRAD_TOL,
    LLAMA_3_2_1B,
    LOSS_TOL,
    PeakMemory,
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
    vocab_size=4098,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
SMOKE_TINY = dict(TINY, vocab_size=258, hidden_size=64, intermediate_size=128, head_dim=16)
SMOKE_1B = dict(LLAMA_3_2_1B, vocab_size=1025, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
OP_SHAPE = dict(n=16384, h=4096, v=128256)
SMOKE_OP_SHAPE = dict(n=64, h=32, v=1001)


def save_llama(shape: dict, path: Path, dtype: torch.dtype) -> Path:
    """Rank 0 saves a random-init Llama of ``shape`` once; every rank then loads it sharded."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    if dist.get_rank() == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), attn_implementation="sdpa")
        model.to(dtype).save_pretrained(path)
        del model
    dist.barrier()
    return path


# A tp_plan="auto" model holds DTensor parameters (the sharded linears) and plain ones (the norms,
# replicated): AdamW's default foreach path groups them together and fails on GPUs, the unpatched
# model too ("aten._foreach_lerp_.Scalar: got mixed torch.Tensor and DTensor"). The per-parameter
# loop takes each parameter alone.
FOREACH = False


def load_tp(path: Path, dtype: torch.dtype, args) -> nn.Module:
    """The checkpoint with transformers' tensor-parallel plan (and FSDP2 with ``--fsdp``)."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_plan="auto", tp_size=args.tp, fsdp_size=args.fsdp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(
            path, distributed_config=config, dtype=dtype, attn_implementation="sdpa"
        )
    return model.train()


def replica(args) -> int:
    """The data-parallel replica of this rank: transformers' mesh is (fsdp, tp), tp innermost."""
    return dist.get_rank() // args.tp


# --------------------------------------------------------------------------------------------
# Part 1: parity
# --------------------------------------------------------------------------------------------


def parity_run(path: Path, patched: bool, dtype: torch.dtype, device: torch.device, args) -> dict:
    shape = SMOKE_TINY if args.smoke else TINY
    model = load_tp(path, dtype, args)
    if patched:
        lp.apply_liger_to(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=FOREACH)
    losses, grads0 = [], {}
    for step in range(args.parity_steps):
        batch = batch_for(step, replica(args), shape["vocab_size"], 4, 32 if args.smoke else 128, device)
        out = model(**batch)
        out.loss.backward()
        if step == 0:
            grads0 = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(out.loss.detach().float().item())
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"losses": losses, "grads0": grads0, "params": params, "logits_none": out.logits is None}


def parity(device: torch.device, args) -> tuple[dict, bool]:
    shape = SMOKE_TINY if args.smoke else TINY
    path = save_llama(shape, args.workdir / f"tiny_v{shape['vocab_size']}", torch.float32)
    ref = parity_run(path, False, torch.float32, device, args)
    plain = parity_run(path, False, torch.bfloat16, device, args)
    fused = parity_run(path, True, torch.bfloat16, device, args)
    grad_pu, grad_pu_name = worst_relative_error(fused["grads0"], plain["grads0"])
    loss_pu = max_abs_diff(fused["losses"], plain["losses"])
    passed = loss_pu <= LOSS_TOL and grad_pu <= GRAD_TOL and fused["logits_none"]
    report = {
        "losses_patched": fused["losses"],
        "losses_unpatched": plain["losses"],
        "losses_fp32_reference": ref["losses"],
        "max_loss_diff_patched_vs_unpatched": loss_pu,
        "max_loss_diff_patched_vs_fp32": max_abs_diff(fused["losses"], ref["losses"]),
        "max_loss_diff_unpatched_vs_fp32": max_abs_diff(plain["losses"], ref["losses"]),
        "step0_grad_rel_err_patched_vs_unpatched": grad_pu,
        "step0_grad_rel_err_worst_param": grad_pu_name,
        "step0_grad_rel_err_patched_vs_fp32": worst_relative_error(fused["grads0"], ref["grads0"])[0],
        "step0_grad_rel_err_unpatched_vs_fp32": worst_relative_error(plain["grads0"], ref["grads0"])[0],
        "final_param_rel_err_patched_vs_unpatched": worst_relative_error(fused["params"], plain["params"])[0],
        "fused_path_ran": fused["logits_none"],
        "passed": passed,
    }
    return report, passed


# --------------------------------------------------------------------------------------------
# Part 2: memory of a training step
# --------------------------------------------------------------------------------------------


def memory_run(path: Path, patched: bool, checkpointing: bool, device: torch.device, args) -> dict:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shape = SMOKE_1B if args.smoke else LLAMA_3_2_1B
    model = load_tp(path, torch.bfloat16, args)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if patched:
        lp.apply_liger_to(model)
    result = {"patched": patched, "activation_checkpointing": checkpointing}
    result.update(training_steps(model, shape["vocab_size"], replica(args), device, args, foreach=FOREACH))
    del model
    return result


def llama_1b_checkpoint(workdir: Path, smoke: bool) -> Path:
    """The memory part's model (the Llama-3.2-1B shape, or its smoke stand-in), saved once in bf16
    under ``workdir``: also what the TP probes in ``experiments/`` load."""
    shape = SMOKE_1B if smoke else LLAMA_3_2_1B
    return save_llama(shape, workdir / f"llama1b_shape_v{shape['vocab_size']}", torch.bfloat16)


def memory(device: torch.device, args) -> list[dict]:
    path = llama_1b_checkpoint(args.workdir, args.smoke)
    rows = []
    for checkpointing in {"both": (False, True), "off": (False,), "on": (True,)}[args.checkpointing]:

        def run(patched: bool, checkpointing: bool = checkpointing) -> dict:
            result = memory_run(path, patched, checkpointing, device, args)
            log(f"  memory run done: patched={patched} checkpointing={checkpointing}")
            return result

        rows += alternating_rounds(run, args.rounds)
    return rows


# --------------------------------------------------------------------------------------------
# Part 3: the op alone
# --------------------------------------------------------------------------------------------


def timed(fn, device: torch.device, reps: int) -> tuple[float, float]:
    """Median seconds of ``fn()`` over ``reps`` runs after a warm-up, and the peak memory (bytes)
    beyond what existed before (0 on CPU). ``fn`` drops the gradients of its last run before
    making new ones, so this is the working memory beyond inputs and gradients."""
    fn()
    times = []
    with PeakMemory() if device.type == "cuda" else contextlib.nullcontext() as mem:
        for _ in range(reps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    extra = mem.peak - mem.start if device.type == "cuda" else 0
    return statistics.median(times), extra


def op_bench(device: torch.device, args) -> dict:
    """Forward + backward of the vocabulary-parallel op against the unsharded op and the floor."""
    s = SMOKE_OP_SHAPE if args.smoke else OP_SHAPE
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(s["n"], s["h"], device=device, dtype=dtype, generator=g).requires_grad_()
    weight = torch.randn(s["v"], s["h"], device=device, dtype=dtype, generator=g) * (3 / s["h"] ** 0.5)
    weight.requires_grad_()
    labels = torch.randint(0, s["v"], (s["n"],), device=device, generator=g)
    labels[torch.rand(s["n"], device=device, generator=g) < 0.2] = -100
    sizes = [len(c) for c in torch.arange(s["v"]).chunk(world)]
    offset = sum(sizes[:rank])
    shard_w = weight.detach()[offset : offset + sizes[rank]].clone().requires_grad_()
    shard = VocabShard(offset, s["v"], None)

    def sharded():
        hidden.grad = shard_w.grad = None
        vocab_parallel_loss(hidden, shard_w, labels, shard=shard).backward()

    def unsharded():
        hidden.grad = weight.grad = None
        lp.fused_linear_cross_entropy(hidden, weight, labels).backward()

    def floor():  # the three GEMMs of the shard: logits, grad_h, grad_W
        with torch.no_grad():
            logits = hidden @ shard_w.t()
            logits @ shard_w
            logits.t() @ hidden

    reps = 2 if args.smoke else 10
    t_shard, m_shard = timed(sharded, device, reps)
    t_full, m_full = timed(unsharded, device, reps)
    t_floor, _ = timed(floor, device, reps)
    return {
        "shape": s,
        "dtype": str(dtype),
        "shard_rows": sizes[rank],
        "vocab_parallel_s": t_shard,
        "unsharded_op_s": t_full,
        "shard_three_gemm_floor_s": t_floor,
        "vocab_parallel_over_floor": t_shard / t_floor,
        "vocab_parallel_extra_mib": m_shard / 2**20,
        "unsharded_op_extra_mib": m_full / 2**20,
    }


# --------------------------------------------------------------------------------------------


def print_tables(parity_report: dict, memory_rows: list[dict], op: dict) -> None:
    r = parity_report
    log("\nbf16 parity, patched vs unpatched (tiny Llama, tp_plan='auto')")
    log(f"max |dloss| {r['max_loss_diff_patched_vs_unpatched']:.2e}   step-0 grad rel err "
        f"{r['step0_grad_rel_err_patched_vs_unpatched']:.2e} ({r['step0_grad_rel_err_worst_param']})   "
        f"vs fp32: patched {r['step0_grad_rel_err_patched_vs_fp32']:.2e}, unpatched "
        f"{r['step0_grad_rel_err_unpatched_vs_fp32']:.2e}   {'pass' if r['passed'] else 'FAIL'}")  # fmt: skip
    if memory_rows:
        log("\nTP, Llama-3.2-1B shape, bf16 weights, AdamW, peak memory per rank")
        log(f"{'act. ckpt':<10} {'variant':<10} {'peak alloc GiB':>15} {'peak reserved GiB':>18} "
            f"{'step s':>8} {'last loss':>10}")  # fmt: skip
        for m in memory_rows:
            alloc, reserved = (m.get(k) for k in ("peak_allocated_gib", "peak_reserved_gib"))
            log(
                f"{'yes' if m['activation_checkpointing'] else 'no':<10} "
                f"{'patched' if m['patched'] else 'unpatched':<10} "
                f"{'n/a' if alloc is None else f'{alloc:.2f}':>15} "
                f"{'n/a' if reserved is None else f'{reserved:.2f}':>18} "
                f"{m['median_step_s']:>8.3f} {m['losses'][-1]:>10.4f}"
            )
    if op:
        ms = {k: op[k] * 1e3 for k in ("vocab_parallel_s", "shard_three_gemm_floor_s", "unsharded_op_s")}
        log(f"\nop alone {op['shape']} {op['dtype']}, forward + backward, rank 0 ({op['shard_rows']} rows)")
        ratio = op["vocab_parallel_over_floor"]
        log(f"  vocab-parallel   {ms['vocab_parallel_s']:8.1f} ms  {ratio:.2f}x the shard's 3-GEMM floor "
            f"({ms['shard_three_gemm_floor_s']:.1f} ms); working memory "
            f"{op['vocab_parallel_extra_mib']:.0f} MiB")  # fmt: skip
        log(f"  unsharded op     {ms['unsharded_op_s']:8.1f} ms  (whole weight, one GPU); working memory "
            f"{op['unsharded_op_extra_mib']:.0f} MiB")  # fmt: skip


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results (written by rank 0)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/liger_patch_tp_gpu"), help="checkpoints")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP2 size (transformers' 2-D mesh; 4 GPUs)")
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--mem-steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="memory runs of each variant, alternating")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="CPU + gloo + tiny shapes: check the script")
    parser.add_argument(
        "--checkpointing", choices=("both", "off", "on"), default="both", help="memory runs without / with it"
    )
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--skip-op", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
    args.tp = int(os.environ["WORLD_SIZE"]) // args.fsdp
    return args


def init(args) -> torch.device:
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
    return device


def main() -> int:
    args = parse_args()
    device = init(args)
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, world {dist.get_world_size()} "
        f"(tp {args.tp} x fsdp {args.fsdp}), {name}")  # fmt: skip
    log("part 1: bf16 parity")
    parity_report, parity_ok = parity(device, args)
    memory_rows = []
    if not args.skip_memory:
        log("part 2: memory")
        memory_rows = memory(device, args)
    op = {}
    if not args.skip_op:
        log("part 3: the op alone")
        op = op_bench(device, args)
    if dist.get_rank() == 0:
        results = {
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "python": platform.python_version(),
                "liger_patch": lp.__version__,
            },
            "device": name,
            "world_size": dist.get_world_size(),
            "tp": args.tp,
            "fsdp": args.fsdp,
            "tokens_per_rank": args.batch * args.seq,
            "tolerances": {"loss_abs": LOSS_TOL, "grad_rel": GRAD_TOL},
            "parity": parity_report,
            "memory_tp_llama_3_2_1b_shape": memory_rows,
            "op": op,
        }
        write_json(args.out, results, indent=2)
    print_tables(parity_report, memory_rows, op)
    log(f"\nwrote {args.out}; parity {'passed' if parity_ok else 'FAILED'}")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
