"""Probe: the Python a fused-loss call runs on the host, counted on a CPU (issue 43, target 1).

A stand-in for the GPU's host path that needs no GPU: the Triton backend on CPU tensors (under
``TRITON_INTERPRET=1``, set here) with every Triton launch replaced by a no-op (the label check's
by a few torch ops that fill its outputs as if every label were in range), and the label check's
answer arriving late, as behind a busy GPU (its event says "not yet" when first asked), so the
call takes the path it takes on CUDA behind a backlog: every row walked, the check deferred.
Nothing the launches would compute is right; the host work around them is the real code's.

At ``--shape`` N,H,V (``--dtype``, bf16 unless told, a quarter of the labels ignored) and
``--chunk-rows`` (0: the plan's), with or without call plans (``--no-plans``), prints the median
µs of a forward + backward (the median of ``--rounds`` rounds, each the median of ``--reps``
calls) and the number of Python function calls and builtin calls (``sys.setprofile`` events) one
forward + backward makes; with ``--by``, those calls counted inclusively under each
``liger_patch`` function. Its figures are this CPU's, a count to compare trees by, not the GPU
host's times (triton_launch_cost.py, op_host_inventory.py and tree_host_ab.py measure those).
Only fp32 inputs take a call plan here (on the CPU half inputs run fp32 GEMMs).

    python benchmarks/experiments/host_calls_cpu.py --by
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # this probe's process only: the Triton backend on CPU tensors

import torch  # noqa: E402

from liger_patch.ops.core import validation  # noqa: E402
from liger_patch.ops.core.triton import common  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy.functional import fused_loss  # noqa: E402
from liger_patch.ops.cross_entropy.options import LossOptions  # noqa: E402


def _no_launch(*args, **kwargs) -> None:
    return None


def _label_check_outputs(labels, safe, row_weight, stats, scalars, items, n, *rest, **kwargs) -> None:
    safe.copy_(labels)
    row_weight.fill_(1.0)
    stats.copy_(torch.tensor([n, 0, 0, 0]))
    scalars.fill_(1.0)


class _StubKernel:
    """What ``jitted(fn)[grid]`` gives here: a no-op, or the label check's stand-in."""

    def __init__(self, fn) -> None:
        self.launch = _label_check_outputs if fn.__name__ == "_label_check_kernel" else _no_launch

    def __getitem__(self, grid):
        return self.launch


class _LateEvent:
    """An event whose work has not run when first asked, and has by the next question."""

    def __init__(self) -> None:
        self.asked = 0

    def query(self) -> bool:
        self.asked += 1
        return self.asked > 1

    def synchronize(self) -> None:
        pass


def _late_check(labels, vocab, ignore_index, divisor, stats) -> validation.ValueCheck:
    return validation.ValueCheck(labels, vocab, ignore_index, divisor, stats.clone(), _LateEvent())


def _stub_the_device() -> None:
    common._jit = lambda fn, interpret: _StubKernel(fn)
    validation.check_from_stats = _late_check


def _call_counts(call) -> tuple[int, collections.Counter]:
    """Profile events of one ``call()``: the total, and per ``liger_patch`` function the events
    under it (inclusive)."""
    total, under = [0], collections.Counter()

    def profile(frame, event, arg) -> None:
        if event not in ("call", "c_call"):
            return
        total[0] += 1
        seen = set()
        while frame is not None:
            name = frame.f_code.co_filename
            if "liger_patch" in name:
                key = f"{name.split('liger_patch/')[-1]}:{frame.f_code.co_name}"
                if key not in seen:
                    seen.add(key)
                    under[key] += 1
            frame = frame.f_back

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return total[0], under


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="64,16,128", help="N,H,V")
    parser.add_argument("--chunk-rows", type=int, default=0, help="Tuning.chunk_rows; 0: the plan's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--by", action="store_true", help="the calls under each liger_patch function")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"],
        help="the inputs' dtype: on the CPU only fp32 inputs run the GEMMs in their own dtype, as "
        "half inputs do on CUDA, so only they take a call plan (Tuning.call_plans)",
    )  # fmt: skip
    parser.add_argument("--no-plans", action="store_true", help="Tuning(call_plans=False)")
    args = parser.parse_args()
    _stub_the_device()
    n, h, v = map(int, args.shape.split(","))
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    hidden = torch.randn(n, h).to(dtype).requires_grad_()
    weight = torch.randn(v, h).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[::4] = -100
    tuning = Tuning(chunk_rows=args.chunk_rows or None, call_plans=not args.no_plans)
    options = LossOptions.from_kwargs(backend="triton", tuning=tuning)

    def call() -> None:
        fused_loss(hidden, weight, labels, options=options).backward()

    for _ in range(200):
        call()
    medians = []
    for _ in range(args.rounds):
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        medians.append(statistics.median(times))
    total, under = _call_counts(call)
    us = 1e6 * statistics.median(medians)
    rows = args.chunk_rows or "planned"
    plans = "off" if args.no_plans else "on"
    head = f"{args.shape} {args.dtype}, chunk rows {rows}, plans {plans}"
    print(f"{head}: {us:.1f} µs a forward + backward on this CPU; {total} calls")
    if args.by:
        for key, count in under.most_common(40):
            print(f"{count:6d}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
