"""Probe: when the op's own CUDA graphs (``Tuning(call_graphs=True)``) cost memory (issue 43).

``graph_step_cost.py`` measured 0.25-0.58 GiB more at a training step's peak with graphs on,
about one grad_W (V x H) of each model, from before any graph was made. Is that held in every
step, or only at the step that captures the graph (the call's own results are alive while the
capture makes the graph's)? Here a head alone, Llama-3.2-1B's (V 128256, H 2048, bf16, 256 tokens,
a quarter ignored), its hidden states an embedding's output, the embedding tied to the head's
weight or not, is stepped with graphs off and on: per step the peak allocated MiB over the
memory before it, what is still allocated after the backward and after the gradients are set to
``None``, what the kept graphs' pools reserve (free blocks included), whether a graph is kept and
whether the weight's gradient is the graph's storage (it was until the graph left grad_W to a
GEMM after each replay: ``core/graphed_forward.Later``).
``--shapes`` takes several N,H,V; a first capture at a tiny shape, not measured, makes what the
side stream sets up once.

    cd benchmarks && python experiments/graph_peak_steps.py --out experiments/results/graph_peak_steps.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import environment, git_head, need_cuda, write_json  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core import call_graph  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy import one_chunk  # noqa: E402

MIB = 1 << 20


def steps(v: int, h: int, n: int, tied: bool, graphs: bool, count: int) -> list[dict]:
    one_chunk.forget()
    torch.cuda.empty_cache()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(v, h, device="cuda", generator=gen) * 0.05).bfloat16())
    table = weight if tied else torch.nn.Parameter(weight.detach().clone())
    ids = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels[: n // 4] = -100
    tuning = Tuning(call_graphs=graphs)
    rows = []
    for step in range(count):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        hidden = F.embedding(ids, table)
        loss = lp.fused_linear_cross_entropy(hidden, weight, labels, tuning=tuning)
        loss.backward()
        torch.cuda.synchronize()
        after_backward = torch.cuda.memory_allocated() - base
        kept = call_graph._GRAPHS.graphs()
        replayed = bool(kept) and any(
            weight.grad.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
            for g in kept for t in g.outputs
        )  # fmt: skip
        peak = torch.cuda.max_memory_allocated() - base
        pools = {tuple(g.pool.id) for g in kept}
        segments = torch.cuda.memory_snapshot()
        pool_reserved = sum(seg["total_size"] for seg in segments if tuple(seg["segment_pool_id"]) in pools)
        weight.grad = table.grad = None
        del hidden, loss
        torch.cuda.synchronize()
        rows.append({
            "step": step, "peak_mib": peak / MIB, "after_backward_mib": after_backward / MIB,
            "after_zero_grad_mib": (torch.cuda.memory_allocated() - base) / MIB,
            "graphs_kept": len(kept), "grad_in_graph_storage": replayed,
            "pool_reserved_mib": pool_reserved / MIB,
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["256,2048,128256"], help="N,H,V each")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--commit", default=None, help="the tree measured (default: git's HEAD)")
    args = parser.parse_args()
    if not need_cuda("graph_peak_steps.py"):
        return 2
    result = {**environment(), "commit": args.commit or git_head(), "runs": []}
    # A first capture, not measured: what the side stream sets up at its first capture (cuBLAS's
    # workspaces, kept for the stream) would otherwise be counted in the first graph's memory.
    steps(256, 64, 8, False, True, 3)
    for shape in args.shapes:
        n, h, v = map(int, shape.split(","))
        for tied in (True, False):
            for graphs in (False, True):
                rows = steps(v, h, n, tied, graphs, args.steps)
                run = {"shape": [n, h, v], "grad_w_mib": v * h * 2 / MIB, "tied": tied, "graphs": graphs}
                result["runs"].append({**run, "steps": rows})
                for r in rows:
                    rounded = {k: round(x, 1) if isinstance(x, float) else x for k, x in r.items()}
                    print({"shape": shape, "tied": tied, "graphs": graphs, **rounded})
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
