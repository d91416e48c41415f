"""Probe: what one Triton launch of ours costs the host, part by part (issue 43).

The label check's kernel (``ops/core/triton/label_check.py``, 10 runtime arguments and 2
constexprs) and the row kernel of the cross-entropy (``ops/cross_entropy/triton/rows.py``, about
40 arguments, its arguments recorded from a real call of the op), launched the same way again and
again behind a GPU backlog (the host never waits), µs per launch, median of ``--reps`` batches of
200: ``jit``, the launch as the op makes it (``kernel[grid](...)``: Triton binds and specializes
every argument, looks the compiled kernel up and launches it); ``binder``, the binding and
specialization alone; ``compiled``, the compiled kernel that the JIT returned launched directly
(``compiled[grid](*args)``), which is what a launch without the binding would cost. JSON to
``--out``.

    python benchmarks/experiments/triton_launch_cost.py --out /tmp/launch_cost.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import make_inputs, need_cuda, write_json  # noqa: E402
from host_bound import Backlog  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core.triton import common as triton_common  # noqa: E402


def _per_launch_us(launch, backlog: Backlog, reps: int, batch: int = 200) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        backlog.queue()
        start = time.perf_counter()
        for _ in range(batch):
            launch()
        times.append(1e6 * (time.perf_counter() - start) / batch)
    torch.cuda.synchronize()
    return statistics.median(times)


class _Recorder:
    """Wraps ``triton_common.jitted`` so that the next launch of ``fn`` records its arguments."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __enter__(self):
        self.original = triton_common.jitted
        recorder = self

        def jitted(fn, interpret=None):
            kernel = recorder.original(fn, interpret)
            if fn is not recorder.fn:
                return kernel

            class Grid:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        recorder.calls.append((kernel, grid, args, kwargs))
                        return kernel[grid](*args, **kwargs)

                    return launch

            return Grid()

        triton_common.jitted = jitted
        self.patched = [
            module
            for module in list(sys.modules.values())
            if getattr(module, "__name__", "").startswith("liger_patch")
            and module.__dict__.get("jitted") is self.original
        ]
        for module in self.patched:
            module.jitted = jitted
        return self

    def __exit__(self, *exc):
        for module in self.patched:
            module.jitted = self.original
        triton_common.jitted = self.original


def _kernel_costs(name: str, kernel_fn, backlog: Backlog, reps: int, run_op) -> dict:
    with _Recorder(kernel_fn) as recorder:
        run_op()
    torch.cuda.synchronize()
    kernel, grid, args, kwargs = recorder.calls[-1]
    compiled = kernel[grid](*args, **kwargs)
    grid3 = (*grid, 1, 1)[:3]  # the compiled kernel takes all three dimensions
    device = torch.cuda.current_device()
    binder = kernel.device_caches[device][-1]
    bound, _, _ = binder(*args, **kwargs)
    values = list(bound.values())
    return {
        "kernel": name,
        "arguments": len(values),
        "jit_us": _per_launch_us(lambda: kernel[grid](*args, **kwargs), backlog, reps),
        "binder_us": _per_launch_us(lambda: binder(*args, **kwargs), backlog, reps),
        "compiled_us": _per_launch_us(lambda: compiled[grid3](*values), backlog, reps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    import triton

    from liger_patch.ops.core.triton.label_check import _label_check_kernel
    from liger_patch.ops.cross_entropy.triton.rows import _ce_rows_kernel

    hidden, weight, labels = make_inputs(256, 896, 151936, ignore_frac=0.25, logit_std=3.0)

    def run_op():
        lp.fused_linear_cross_entropy(hidden, weight, labels).backward()

    backlog = Backlog("cuda")
    rows = [
        _kernel_costs("label_check", _label_check_kernel, backlog, args.reps, run_op),
        _kernel_costs("ce_rows", _ce_rows_kernel, backlog, args.reps, run_op),
    ]
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    result = {"device": torch.cuda.get_device_name(), **versions}
    result["rows"] = rows
    write_json(args.out, result, indent=2)
    for row in rows:
        print(row, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
