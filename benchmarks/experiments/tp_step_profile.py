"""Probe: where a tensor-parallel training step spends its time, unpatched and patched (issue 43).

``tp_gpu.py``'s memory part without activation checkpointing (the Llama-3.2-1B shape, bf16,
``tp_plan="auto"`` over 2 GPUs, AdamW, 8 x 2048 tokens per rank, a quarter of each sequence
ignored), one model per variant and round, the order alternating: ``--warmup`` unprofiled steps,
then ``--steps`` steps under ``torch.profiler``, each on its own. Per step and rank: the wall time
(synchronised), the GPU time of the compute kernels and of NCCL's (summed; NCCL's includes its
wait for the other rank), the host's waits on the GPU (CPU time inside synchronising CUDA calls)
and the kernel count; then the kernels whose summed time differs most between the variants (rank
0, the median step). JSON to ``--out``.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --nproc-per-node 2 \\
        benchmarks/experiments/tp_step_profile.py --out /tmp/tp_profile.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import LLAMA_3_2_1B, batch_for, profiled_step, write_json  # noqa: E402
from tp_gpu import FOREACH, init, llama_1b_checkpoint, load_tp, replica  # noqa: E402

import liger_patch as lp  # noqa: E402


def _step(model, optimizer, batch) -> None:
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _profiled_step(model, optimizer, batch) -> tuple[dict, collections.Counter]:
    """One step under the profiler, both ranks starting together: its figures, and its kernels'
    summed ms by name."""
    torch.cuda.synchronize()
    dist.barrier()
    found = profiled_step(lambda: _step(model, optimizer, batch))
    kernels = found["kernel_ms"]
    nccl = sum(ms for name, ms in kernels.items() if "nccl" in name.lower())
    figures = {
        "wall_ms": found["wall_ms"],
        "compute_ms": sum(kernels.values()) - nccl,
        "nccl_ms": nccl,
        "host_wait_ms": sum(found["host_wait_ms"].values()),
        "host_waits": dict(found["host_wait_ms"]),
        "kernels": found["kernels"],
    }
    return figures, kernels


def run(path: Path, patched: bool, device: torch.device, args) -> dict:
    """One model, ``--warmup`` steps, then ``--steps`` profiled ones; every rank's figures."""
    gc.collect()
    torch.cuda.empty_cache()
    model = load_tp(path, torch.bfloat16, args)
    if patched:
        lp.apply_liger_to(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=FOREACH)
    vocab = LLAMA_3_2_1B["vocab_size"]
    for step in range(args.warmup):
        _step(model, optimizer, batch_for(step, replica(args), vocab, args.batch, args.seq, device))
    steps, kernels = [], []
    for step in range(args.warmup, args.warmup + args.steps):
        batch = batch_for(step, replica(args), vocab, args.batch, args.seq, device)
        figures, by_kernel = _profiled_step(model, optimizer, batch)
        steps.append(figures)
        kernels.append(by_kernel)
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, steps)
    median = sorted(range(len(steps)), key=lambda i: steps[i]["wall_ms"])[len(steps) // 2]
    del model, optimizer
    return {"patched": patched, "steps_per_rank": every_rank, "median_step_kernels": kernels[median]}


def summary(runs: list[dict]) -> dict:
    """Per variant, the medians over rounds, steps and ranks; the kernels that differ most."""
    out = {}
    for patched in (False, True):
        mine = [r for r in runs if r["patched"] == patched]
        steps = [s for r in mine for rank in r["steps_per_rank"] for s in rank]
        keys = ("wall_ms", "compute_ms", "nccl_ms", "host_wait_ms", "kernels")
        out["patched" if patched else "unpatched"] = {k: statistics.median(s[k] for s in steps) for k in keys}
    kernels = {p: collections.Counter() for p in (False, True)}
    for r in runs:
        kernels[r["patched"]].update(r["median_step_kernels"])
    rounds = len(runs) // 2
    names = set(kernels[True]) | set(kernels[False])
    diff = {k: (kernels[True][k] - kernels[False][k]) / rounds for k in names}
    out["kernel_ms_patched_minus_unpatched"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:15])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/liger_patch_tp_gpu"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    args.fsdp, args.smoke = 1, False
    args.tp = int(os.environ["WORLD_SIZE"])
    device = init(args)
    if device.type != "cuda":
        print("tp_step_profile.py needs CUDA GPUs", file=sys.stderr)
        return 2
    path = llama_1b_checkpoint(args.workdir, smoke=False)
    runs = []
    for r in range(args.rounds):
        for patched in (False, True) if r % 2 == 0 else (True, False):
            runs.append(run(path, patched, device, args))
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "runs": runs}
    result["summary"] = summary(runs)
    if dist.get_rank() == 0:
        import transformers

        result["transformers"] = transformers.__version__
        write_json(args.out, result, indent=2)
        print(result["summary"], flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
