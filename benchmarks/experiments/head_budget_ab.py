"""The op at the end-to-end rows' head shapes under several memory budgets: what a smaller
working budget costs in time where a training step's peak is set by the head's forward
(docs/perf-notes.md item 30).

    python benchmarks/experiments/head_budget_ab.py --out benchmarks/experiments/results/head_budget_ab.json

For each (N, H, V): the three-GEMM floor, then the op (fwd+bwd, bf16, logit std 3, every label
kept, as a packed batch) at each budget, in ``--rounds`` rounds whose order rotates, so that
clock drift hits every budget alike. Reports per-budget medians (ms, × floor) and extra MiB.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from chunk_sweep import op_with  # noqa: E402  (this script's folder is on sys.path)
from common import (  # noqa: E402
    bench,
    environment,
    extra_memory_mib,
    fwd_bwd,
    make_inputs,
    need_cuda,
    time_floor,
    write_json,
)

HEADS = "16384x2048x128256,32768x2048x128256,32768x896x151936,16384x3584x152064"


def sweep(shape: str, budgets: list[int], rounds: int, rep_ms: int) -> dict:
    n, h, v = (int(x) for x in shape.split("x"))
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, 0.0, logit_std=3.0)
    floor = time_floor(hidden, weight, rep_ms)
    times: dict[int, list[float]] = {b: [] for b in budgets}
    for r in range(rounds):
        for b in budgets[r % len(budgets) :] + budgets[: r % len(budgets)]:
            fn = op_with(b, input_dtype_logits=True)
            fwd_bwd(fn, hidden, weight, labels)
            times[b].append(bench(lambda fn=fn: fwd_bwd(fn, hidden, weight, labels), rep_ms))
    row = {"shape": shape, "floor_ms": floor, "budgets": {}}
    for b in budgets:
        ms = statistics.median(times[b])
        mem = extra_memory_mib(op_with(b, input_dtype_logits=True), hidden, weight, labels)
        row["budgets"][f"{b}MiB"] = {"ms": ms, "x_floor": ms / floor, "extra_mib": mem, "all_ms": times[b]}
        print(shape, f"{b} MiB {ms:.2f} ms {ms / floor:.3f}x {mem:.0f} MiB", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=HEADS, help="comma list of NxHxV")
    parser.add_argument("--budgets", default="512,448,384,320,256", help="MiB, comma list")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/experiments/head_budget_ab.py"):
        return 2
    budgets = [int(b) for b in args.budgets.split(",")]
    result = {**environment(), "rounds": args.rounds, "rows": []}
    for shape in args.shapes.split(","):
        result["rows"].append(sweep(shape, budgets, args.rounds, args.rep_ms))
        torch.cuda.empty_cache()
        if args.out:  # after every shape, so that a cut-off run keeps what it measured
            write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
