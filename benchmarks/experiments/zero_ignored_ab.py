"""Where ours loses at 0 % ignored labels, and what the per-chunk gradient GEMMs cost (issue 29).

Two parts, one run, one GPU:

1. ``gemms``: at each point, the chunk size ours plans (read from the planner), the two gradient
   GEMMs of one chunk: grad_h = G W (rows x V x H) and grad_W += G^T h (V x rows x H, bf16 C read
   and written), alone, one after the other, and on two streams (grad_h launched first, then
   grad_W first), summed over the chunks of N tokens; against the same two GEMMs over all N
   tokens at once (what a method holding every logit pays).
2. ``ops``: the whole op, fwd+bwd, 0 % ignored: ours at 512 MiB, 1 and 2 GiB, and the floor,
   rotated over ``--rounds`` (medians).

The run in ``results/zero_ignored_ab.json`` also timed a variant that ran each chunk's grad_h
GEMM on a second stream beside its grad_W GEMM (``ours_overlap``, ``ours_overlap_1gib``; the
code was not kept: docs/perf-notes.md item 32).

    python benchmarks/experiments/zero_ignored_ab.py --out benchmarks/experiments/results/zero_ignored_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import bench, environment, extra_memory_mib, fwd_bwd, make_inputs, time_floor, write_json  # noqa: E402

POINTS = (  # (N, H, V, softcap): where ours_all_rows trailed torch.compile in docs/results/grid.json
    (8192, 2048, 128256, None),
    (8192, 4096, 128256, None),
    (4096, 1152, 262144, None),
    (4096, 2560, 262144, None),
    (16384, 2560, 262144, None),
    (8192, 3584, 152064, None),
    (4096, 2880, 201088, None),
    (16384, 1536, 151936, None),
    (8192, 2304, 256000, 30.0),
)


def planned_rows(n: int, h: int, v: int, budget: int) -> int:
    """The token-chunk rows ours plans for this call (the planner's own answer, recorded)."""
    from liger_patch import fused_linear_cross_entropy
    from liger_patch.ops.cross_entropy import chunks as chunked

    seen = []
    real = chunked.plan_chunks

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        seen.append(plan.rows)
        return plan

    chunked.plan_chunks = spy
    try:
        hidden, weight, labels = make_inputs(n, h, v, logit_std=3.0)
        fused_linear_cross_entropy(hidden, weight, labels, memory_budget=budget).backward()
    finally:
        chunked.plan_chunks = real
    return seen[0]


def gemm_pair(n: int, h: int, v: int, rows: int, rep_ms: int) -> dict:
    dev = "cuda"
    g = torch.randn(rows, v, device=dev, dtype=torch.bfloat16) * 1e-3
    w = torch.randn(v, h, device=dev, dtype=torch.bfloat16)
    x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
    gh = torch.empty(rows, h, device=dev, dtype=torch.bfloat16)
    gw = torch.randn(v, h, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def grad_h():
        torch.mm(g, w, out=gh)

    def grad_w():
        gw.addmm_(g.t(), x)

    def both():
        grad_h()
        grad_w()

    def overlapped(h_first: bool):
        def run():
            side.wait_stream(main)
            if h_first:
                with torch.cuda.stream(side):
                    grad_h()
                grad_w()
            else:
                with torch.cuda.stream(side):
                    grad_w()
                grad_h()
            main.wait_stream(side)

        return run

    chunks = n / rows
    out = {"rows": rows, "chunks": chunks}
    for name, fn in (
        ("grad_h", grad_h),
        ("grad_w", grad_w),
        ("sequential", both),
        ("overlap_h_first", overlapped(True)),
        ("overlap_w_first", overlapped(False)),
    ):
        out[name + "_ms"] = bench(fn, rep_ms) * chunks
    gfull = torch.randn(n, v, device=dev, dtype=torch.bfloat16) * 1e-3
    xfull = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    ghfull = torch.empty(n, h, device=dev, dtype=torch.bfloat16)
    out["grad_h_all_tokens_ms"] = bench(lambda: torch.mm(gfull, w, out=ghfull), rep_ms)
    out["grad_w_all_tokens_ms"] = bench(lambda: torch.mm(gfull.t(), xfull, out=gw), rep_ms)
    return out


def op_variants() -> dict:
    from liger_patch import fused_linear_cross_entropy

    def ours(**kw):
        def fn(hidden, weight, labels, softcap=None):
            return fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap, **kw)

        return fn

    return {
        "ours": ours(),
        "ours_1gib": ours(memory_budget=1 << 30),
        "ours_2gib": ours(memory_budget=2 << 30),
    }


def op_point(n, h, v, softcap, rounds, rep_ms) -> dict:
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, 0.0, logit_std=3.0)
    impls = op_variants()
    names = list(impls)
    floors, times, extra = [], {k: [] for k in names}, {}
    for r in range(rounds):
        floors.append(time_floor(hidden.detach(), weight.detach(), rep_ms))
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn = lambda hh, ww, ll, f=impls[name]: f(hh, ww, ll, softcap)  # noqa: E731
            fwd_bwd(fn, hidden, weight, labels)
            times[name].append(bench(lambda fn=fn: fwd_bwd(fn, hidden, weight, labels), rep_ms))
            if r == 0:
                extra[name] = extra_memory_mib(fn, hidden, weight, labels)
            hidden.grad = weight.grad = None
    floor = statistics.median(floors)
    return {
        "floor_ms": floor,
        "impls": {
            k: {
                "ms": statistics.median(t),
                "x_floor": statistics.median([a / b for a, b in zip(t, floors, strict=True)]),
                "ms_rounds": t,
                "extra_mib": extra[k],
            }
            for k, t in times.items()
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--parts", default="gemms,ops")
    p.add_argument("--points", default=None, help="indices I,J,... of POINTS")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    points = POINTS if args.points is None else [POINTS[int(i)] for i in args.points.split(",")]
    result = {**environment(), "rows": []}
    for n, h, v, softcap in points:
        row = {"N": n, "H": h, "V": v, "softcap": softcap, "ignore_frac": 0.0}
        if "gemms" in args.parts:
            row["gemms"] = gemm_pair(n, h, v, planned_rows(n, h, v, 512 << 20), args.rep_ms)
        if "ops" in args.parts:
            row.update(op_point(n, h, v, softcap, args.rounds, args.rep_ms))
        result["rows"].append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
