"""Where the distillation op's time goes beyond its four-GEMM floor (issue 30; perf-notes item 43).

At ``benchmarks/distill.py``'s pairs (8192 tokens by default, bf16, β 0.5, logit std 3, nothing
ignored): the op's fwd+bwd median and the floor's (``do_bench``), then one profiled warm call
(``torch.profiler``, CPU and CUDA): GPU time summed per kernel kind, the call's GPU span and busy
time, and every idle stretch of at least ``--min-us`` with the kernels around it and the CPU
operators that ran in it. ``--ncu`` runs one call only (for Nsight Compute to profile the row
kernel: see the command below).

    PYTHONPATH=.:benchmarks python benchmarks/experiments/distill_profile.py \\
        --out benchmarks/experiments/results/distill_profile.json
    ncu --kernel-name regex:_distill_rows_kernel --launch-skip 8 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        --section Occupancy --section LaunchStats \\
        python benchmarks/experiments/distill_profile.py --ncu
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import distill  # noqa: E402
from common import environment, write_json  # noqa: E402

KINDS = (  # (kind, pattern over the kernel's name), first match wins
    ("row kernel", r"_distill_rows_kernel"),
    ("fused logits GEMM", r"_logits_lse_kernel"),
    ("cuBLAS GEMM", r"gemm|sm90_xmma|cutlass|nvjet"),
    ("label check and small", r"reduce|elementwise|index|copy|fill|nonzero|cat|arange|Memcpy|Memset"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def call(fn, s_h, s_w, labels) -> None:
    s_h.grad = s_w.grad = None
    fn(s_h, s_w, labels).backward()


def profile(fn, s_h, s_w, labels, min_us: float) -> dict:
    for _ in range(3):
        call(fn, s_h, s_w, labels)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        call(fn, s_h, s_w, labels)
        torch.cuda.synchronize()
    events = prof.events()
    on_gpu = (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    gpu = sorted(on_gpu, key=lambda e: e.time_range.start)
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    per_kind: dict[str, float] = collections.defaultdict(float)
    per_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in gpu:
        us = e.time_range.end - e.time_range.start
        per_kind[kind_of(e.name)] += us
        per_name[e.name[:80]][0] += 1
        per_name[e.name[:80]][1] += us
    gaps, idle = [], 0.0
    for a, b in zip(gpu, gpu[1:], strict=False):
        gap = b.time_range.start - a.time_range.end
        if gap < min_us:
            continue
        idle += gap
        start, end = a.time_range.end, b.time_range.start
        during = sorted({e.name for e in cpu if e.time_range.start < end and e.time_range.end > start})
        gaps.append({"us": gap, "after": a.name[:60], "before": b.name[:60], "cpu": during[:25]})
    first_cpu = min(e.time_range.start for e in cpu)
    return {
        "host_before_first_kernel_us": gpu[0].time_range.start - first_cpu,
        "span_us": gpu[-1].time_range.end - gpu[0].time_range.start,
        "busy_us": sum(e.time_range.end - e.time_range.start for e in gpu),
        "kernels": len(gpu),
        "per_kind_us": dict(per_kind),
        "per_name": {
            k: {"count": c, "us": us} for k, (c, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])
        },
        "idle_listed_us": idle,
        "gaps": gaps,
    }


def pair_row(index: int, tokens: int, min_us: float, ncu: bool) -> dict | None:
    """One pair's timings and profile (printed as they come); with ``ncu`` ten calls only."""
    import triton

    pair, h_s, h_t, v = distill.PAIRS[index]
    point = distill.DistillPoint(pair, tokens, h_s, h_t, v)
    s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.bfloat16, 0.0, 0.9, "cuda")
    fn = distill.bound("ours", distill.Setting(teacher=(t_h, t_w)))
    if ncu:
        for _ in range(10):
            call(fn, s_h, s_w, labels)
        torch.cuda.synchronize()
        return None
    ms = triton.testing.do_bench(lambda: call(fn, s_h, s_w, labels), warmup=50, rep=1000)
    floor = distill.time_floor(s_h, s_w, t_h, t_w, 1000)
    row = {"point": point.name, "ms": ms, "floor_ms": floor, "x_floor": ms / floor}
    row |= profile(fn, s_h, s_w, labels, min_us)
    print(point.name, f"{ms:.2f} ms, floor {floor:.2f}, x{ms / floor:.3f}", flush=True)
    print(
        f"  span {row['span_us']:.0f} busy {row['busy_us']:.0f} idle>={min_us:g} {row['idle_listed_us']:.0f}"
        f" us, {row['kernels']} kernels, host before first {row['host_before_first_kernel_us']:.0f} us",
        flush=True,
    )
    for kind, us in sorted(row["per_kind_us"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:24s} {us:9.0f} us", flush=True)
    for name, e in list(row["per_name"].items())[:12]:
        print(f"    {e['count']:3d} x {name[:70]:70s} {e['us']:9.0f}", flush=True)
    for g in row["gaps"]:
        print(f"  gap {g['us']:6.0f} us after {g['after'][:40]} before {g['before'][:40]}", flush=True)
        print("      cpu:", ", ".join(g["cpu"])[:300], flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--pairs", default="0,1,2", help="indices into distill.PAIRS")
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--ncu", action="store_true", help="ten calls at the first pair, nothing else")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    result = {**environment(), "tokens": args.tokens, "beta": 0.5, "rows": []}
    for index in (int(x) for x in args.pairs.split(",")):
        row = pair_row(index, args.tokens, args.min_us, args.ncu)
        if row is None:
            return 0
        result["rows"].append(row)
        torch.cuda.empty_cache()
        if args.out:
            write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
