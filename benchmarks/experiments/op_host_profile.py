"""Probe: where the host time of one fused-loss call goes when it does not wait (issue 43).

Behind a long GPU spin (so nothing the host queues runs, and nothing waits), ``--calls`` forward +
backward calls of ``fused_linear_cross_entropy`` at each ``--shapes`` N,H,V (bf16, 25 % of labels
ignored) are run under ``cProfile``; printed: host ms per call, the functions with the most own
and cumulative time, and the CUDA launches per call (``torch.profiler``'s count of device
kernels and memsets).

    python benchmarks/experiments/op_host_profile.py --shapes 1024,896,151936 4096,2048,128256
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import make_inputs, need_cuda  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core import deferred_checks  # noqa: E402

SPIN = 2_000_000_000  # about 1 s of GPU spin at 2 GHz


def step(hidden, weight, labels) -> None:
    hidden.grad = weight.grad = None
    lp.fused_linear_cross_entropy(hidden, weight, labels).backward()


def profile_shape(n: int, h: int, v: int, calls: int) -> None:
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)
    for _ in range(3):  # behind a spin, as measured: the kernels of the path that does not wait load
        torch.cuda._sleep(SPIN // 20)
        step(hidden, weight, labels)
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    torch.cuda._sleep(SPIN)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        step(hidden, weight, labels)
    profiler.disable()
    ms = 1e3 * (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    print(f"\n=== N={n} H={h} V={v}: {ms:.2f} host ms per call (under cProfile) ===")
    by_file: dict[str, float] = {}
    for (file, _, _), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        where = "liger_patch" if "liger_patch" in file else file.split("site-packages/")[-1].split("/")[0]
        by_file[where] = by_file.get(where, 0.0) + tottime
    for where, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:8]:
        print(f"  own time in {where}: {1e3 * seconds / calls:.3f} ms per call")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats(key).print_stats(28)
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    torch.cuda._sleep(SPIN // 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(hidden, weight, labels)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"device kernels and copies per call: {len(kernels)}")
    names = {}
    for e in kernels:
        names[e.name[:70]] = names.get(e.name[:70], 0) + 1
    for name, count in sorted(names.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {count:3d}  {name}")
    deferred_checks.raise_pending()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1024,896,151936", "8192,4096,128256"])
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    for shape in args.shapes:
        profile_shape(*map(int, shape.split(",")), args.calls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
