"""Probe: what a capture of the op's own CUDA graph leaves reserved (issue 43).

``Tuning(call_graphs=True)``: a signature's capturing call first runs the forward once on the
side stream it captures on (a warm-up), then captures it into the graph's pool. Memory the
warm-up allocated from the default pool stays cached for the side stream, reserved but usable
by nothing else. Here a head alone (bf16, untied leaf weight, nothing ignored), at two shapes, is
called until its graph is captured: the reserved and allocated MiB from after the call before
(its gradients still held) to after the capturing call (its gradients set to ``None``), the side
stream's default-pool memory and its free part, and the graph pools' size.

    cd benchmarks && python experiments/graph_reserved_memory.py \
        --out experiments/results/graph_reserved_memory.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from common import environment, need_cuda, write_json  # noqa: E402

SHAPES = ((256, 2048, 128256), (2048, 4096, 128256))
MIB = 2**20


def _stream_pool_mib(stream: int) -> tuple[float, float]:
    """MiB of the default pool's segments on ``stream``, and of their free blocks."""
    segments = [
        s for s in torch.cuda.memory_snapshot() if s["stream"] == stream and s["segment_pool_id"] == (0, 0)
    ]
    free = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive")
    return sum(s["total_size"] for s in segments) / MIB, free / MIB


def capture_row(n: int, h: int, v: int) -> dict:
    """The capturing call's memory at one shape (its first calls: a read check, a plain run)."""
    import liger_patch as lp
    from liger_patch.ops.core import call_graph
    from liger_patch.ops.core.tuning import Tuning

    graphs = Tuning(call_graphs=True)
    call_graph.forget()
    torch.cuda.empty_cache()
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * h**-0.5).requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda")

    def step() -> None:
        hidden.grad = weight.grad = None
        lp.fused_linear_cross_entropy(hidden, weight, labels, tuning=graphs).backward()
        torch.cuda.synchronize()

    step()  # reads its check first (no share known yet)
    step()  # notes where the weight is
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    step()  # captures
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    side = next(iter(call_graph._SIDE_STREAMS.values())).cuda_stream
    side_mib, side_free_mib = _stream_pool_mib(side)
    pools = sum(s["total_size"] for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] != (0, 0))
    return {
        "N": n, "H": h, "V": v, "grad_W_MiB": v * h * 2 / MIB,
        "reserved_delta_MiB": (torch.cuda.memory_reserved() - reserved) / MIB,
        "allocated_delta_MiB": (torch.cuda.memory_allocated() - allocated) / MIB,
        "side_stream_default_pool_MiB": side_mib, "side_stream_default_pool_free_MiB": side_free_mib,
        "graph_pools_MiB": pools / MIB, "graphs": len(call_graph._GRAPHS.graphs()),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    rows = [capture_row(*shape) for shape in SHAPES]
    for row in rows:
        print(row)
    if args.out:
        write_json(args.out, {**environment(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
