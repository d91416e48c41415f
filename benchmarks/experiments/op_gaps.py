"""Where the GPU waits during one fwd+bwd of the op: idle gaps between its kernels.

One warm call of each implementation runs under ``torch.profiler`` (CPU and CUDA); the GPU
kernels and copies are put in time order and every idle stretch of at least ``--min-us`` between
the end of one and the start of the next is listed with the kernels around it and the CPU
operators that ran in that stretch (what the host was doing while the GPU waited).

    python benchmarks/experiments/op_gaps.py --shape 8192x2048x128256 \\
        --out benchmarks/experiments/results/op_gaps.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flce  # noqa: E402
from common import environment, fwd_bwd, make_inputs, write_json  # noqa: E402


def gaps(fn, hidden, weight, labels, min_us: float) -> dict:
    for _ in range(3):
        fwd_bwd(fn, hidden, weight, labels)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fwd_bwd(fn, hidden, weight, labels)
        torch.cuda.synchronize()
    events = prof.events()
    gpu = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    out, idle = [], 0.0
    for a, b in zip(gpu, gpu[1:], strict=False):
        gap = b.time_range.start - a.time_range.end
        if gap < min_us:
            continue
        idle += gap
        during = sorted(
            {
                e.name
                for e in cpu
                if e.time_range.start < b.time_range.start and e.time_range.end > a.time_range.end
            }
        )
        out.append({"us": gap, "after": a.name[:60], "before": b.name[:60], "cpu": during[:25]})
    span = gpu[-1].time_range.end - gpu[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in gpu)
    return {"span_us": span, "busy_us": busy, "idle_listed_us": idle, "gaps": out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="8192x2048x128256")
    p.add_argument("--impls", default="ours,torch_compile")
    p.add_argument("--ignore-frac", type=float, default=0.0)
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    n, h, v = (int(x) for x in args.shape.split("x"))
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, args.ignore_frac, logit_std=3.0)
    result = {**environment(), "shape": args.shape, "ignore_frac": args.ignore_frac, "impls": {}}
    for name in args.impls.split(","):
        r = gaps(flce.IMPLS[name], hidden, weight, labels, args.min_us)
        result["impls"][name] = r
        print(
            name,
            f"span {r['span_us']:.0f} us, busy {r['busy_us']:.0f}, gaps >= {args.min_us} us: "
            f"{r['idle_listed_us']:.0f}",
            flush=True,
        )
        for g in r["gaps"]:
            print(f"  {g['us']:7.0f} us after {g['after']} before {g['before']}", flush=True)
            print("           cpu:", ", ".join(g["cpu"])[:400], flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
