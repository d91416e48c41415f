"""Where each implementation's GPU time goes: kernel times of one fwd+bwd, summed by kernel.

For every shape and implementation (names of ``benchmarks/flce.py``'s ``IMPLS``, plus
``ours_2gib``), a few warm fwd+bwd calls run under ``torch.profiler``; the kernels' device times
are summed by kernel name (per call) and the largest listed, beside the call's total kernel time,
its wall time (``do_bench`` median: what the kernel time leaves idle is the gap) and the
three-GEMM floor timed in the same run. Used for issue 29 (0 % ignored labels).

    python benchmarks/experiments/op_profile.py --shapes 4096x2560x262144 --impls ours,torch_compile \\
        --out benchmarks/experiments/results/op_profile.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flce  # noqa: E402
from common import bench, environment, fwd_bwd, make_inputs, time_floor, write_json  # noqa: E402

CALLS = 3


def _impl(name: str):
    if name == "ours_2gib":
        return lambda h, w, y, softcap=None: flce.ours(h, w, y, softcap, memory_budget=2 << 30)
    return flce.IMPLS[name]


def kernel_times(fn, hidden, weight, labels) -> tuple[float, list]:
    """Per call: total kernel ms, and (ms, launches, name) summed by kernel name, largest first."""
    for _ in range(2):
        fwd_bwd(fn, hidden, weight, labels)
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(CALLS):
            fwd_bwd(fn, hidden, weight, labels)
        torch.cuda.synchronize()
    per_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name][0] += event.device_time_total / 1e3 / CALLS
            per_name[event.name][1] += 1
    rows = sorted(((ms, n // CALLS, name[:140]) for name, (ms, n) in per_name.items()), reverse=True)
    return sum(r[0] for r in rows), rows[:14]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="4096x2560x262144")
    p.add_argument("--impls", default="ours,ours_2gib,torch_compile")
    p.add_argument("--ignore-frac", type=float, default=0.0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {**environment(), "ignore_frac": args.ignore_frac, "rows": []}
    for shape in args.shapes.split(","):
        n, h, v = (int(x) for x in shape.split("x"))
        hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, args.ignore_frac, logit_std=3.0)
        row = {"shape": shape, "floor_ms": time_floor(hidden.detach(), weight.detach(), 200), "impls": {}}
        flce.reset_compiled()
        for name in args.impls.split(","):
            fn = _impl(name)
            total, top = kernel_times(fn, hidden, weight, labels)
            wall = bench(lambda fn=fn, h=hidden, w=weight, y=labels: fwd_bwd(fn, h, w, y), 300)
            row["impls"][name] = {"kernel_ms": total, "wall_ms": wall, "top": top}
            print(
                shape,
                name,
                f"kernels {total:.2f} ms, wall {wall:.2f} (floor {row['floor_ms']:.2f})",
                flush=True,
            )
            for ms, launches, kname in top[:8]:
                print(f"   {ms:8.3f} ms {launches:4d}x {kname[:100]}", flush=True)
            hidden.grad = weight.grad = None
            torch.cuda.empty_cache()
        result["rows"].append(row)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
