"""The vocabulary-parallel distillation op on 2 GPUs against its own floor and the whole op on one.

At ``distill.py``'s three head pairs (8192 tokens, bf16, beta 0.5, teacher correlation 0.9, no
label ignored and 20 % ignored), each rank holds half of both heads' rows (``torch.chunk``) and
the same hidden states and labels, and times a forward + backward of
``vocab_parallel_distillation`` (the ranks in step: a barrier, then a fixed number of calls timed
with CUDA events, the median of per-call times); then, without collectives, the four GEMMs on
its half (the sharded floor: student and teacher logits, grad_h, grad_W), and the whole op and
its floor on the whole heads, as ``distill.py`` times them. Rank 0 writes the JSON.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/experiments/tp_distill_op.py \\
        --out benchmarks/experiments/results/tp_distill_op.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from distill import POINTS, floor_fn, make_distill_inputs  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core.vocab_shard import VocabShard  # noqa: E402
from liger_patch.ops.distillation.vocab_parallel import vocab_parallel_distillation  # noqa: E402


def timed(fn, calls: int = 10, warmup: int = 3) -> float:
    """Median ms of ``fn()`` over ``calls`` calls after ``warmup``, the ranks started together."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def fwd_bwd(loss_fn, s_h, s_w) -> None:
    s_h.grad = s_w.grad = None
    loss_fn().backward()


def point_row(index: int, ignore: float, rank: int, world: int) -> dict:
    pt = POINTS[index]
    s_h, s_w, labels, t_h, t_w = make_distill_inputs(pt, torch.bfloat16, ignore, 0.9, "cuda", seed=0)
    rows = torch.arange(pt.v, device="cuda").chunk(world)[rank]
    part = slice(int(rows[0]), int(rows[-1]) + 1)
    sw_r = s_w.detach()[part].clone().requires_grad_()
    tw_r = t_w[part].contiguous()
    shard = VocabShard(part.start, pt.v)
    opts = dict(beta=0.5, temperature=1.0)
    sharded = timed(
        lambda: fwd_bwd(
            lambda: vocab_parallel_distillation(s_h, sw_r, t_h, tw_r, labels, shard=shard, **opts), s_h, sw_r
        )
    )
    loss_sharded = float(vocab_parallel_distillation(s_h, sw_r, t_h, tw_r, labels, shard=shard, **opts))
    g = torch.randn(pt.n, sw_r.shape[0], device="cuda", dtype=torch.bfloat16) * 1e-4
    floor_shard = timed(lambda: floor_fn(s_h.detach(), sw_r.detach(), t_h, tw_r, g))
    del g
    whole_op = lambda: lp.fused_linear_distillation(s_h, s_w, t_h, t_w, labels, **opts)
    whole = timed(lambda: fwd_bwd(whole_op, s_h, s_w))
    loss_whole = float(whole_op())
    g = torch.randn(pt.n, pt.v, device="cuda", dtype=torch.bfloat16) * 1e-4
    floor_whole = timed(lambda: floor_fn(s_h.detach(), s_w.detach(), t_h, t_w, g))
    return {
        "pair": pt.pair, "n": pt.n, "ignored": ignore, "sharded_ms": sharded, "floor_shard_ms": floor_shard,
        "sharded_x_floor": sharded / floor_shard, "whole_ms": whole, "floor_whole_ms": floor_whole,
        "whole_x_floor": whole / floor_whole, "loss_sharded": loss_sharded, "loss_whole": loss_whole,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    rows = []
    for index in (2, 6, 10):
        for ignore in (0.0, 0.2):
            row = point_row(index, ignore, rank, world)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if rank == 0:
        device = f"{world}x {torch.cuda.get_device_name()}"
        result = {"device": device, "torch": torch.__version__, "rows": rows}
        args.out.write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
