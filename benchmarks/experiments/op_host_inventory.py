"""Probe: every host-side operation of one fused-loss forward + backward on CUDA, and where in
``liger_patch`` it is issued (issue 43, target 1).

At ``--shapes`` N,H,V (bf16, a quarter of the labels -100, logit std 3), warm, behind about 100 ms
of queued GPU work so that no call waits, ``--calls`` forward + backward calls of ours, then of
eager's, twice:

* under ``torch.profiler`` (CPU and CUDA): per call, each top-level aten operator and each CUDA
  runtime / driver call (kernel launches, copies, events, syncs) by name, with its count and
  median host µs, and the totals by kind;
* under a profile function on every thread (``threading.setprofile_all_threads``; the backward
  runs on autograd's device thread): per call, the calls into compiled code (torch, Triton, the
  C builtins) made from each line of ``liger_patch`` (for eager, of the benchmark's own code), by
  callee. The profiler's own stacks do not reach our lines here.

A count of what a call issues and from where, to tell which of its operations could go. JSON to
``--out``.

    python benchmarks/experiments/op_host_inventory.py --out /tmp/inventory.json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import statistics
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import fwd_bwd, make_inputs, need_cuda  # noqa: E402
from host_bound import Backlog, eager_loss, ours_loss  # noqa: E402

from liger_patch.ops.core import deferred_checks  # noqa: E402

VARIANTS = ("ours", "eager")
_RUNTIME = ("cuda", "cu")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, cudaEventRecord, ...


def _top_level(events) -> list:
    """Events no aten operator encloses: what the Python issued itself."""
    out = []
    for e in events:
        is_op = e.name.startswith("aten::") or e.name.startswith("liger_patch::")
        is_rt = e.name.startswith(_RUNTIME) and e.device_type == torch.autograd.DeviceType.CPU
        if not (is_op or is_rt):
            continue
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            out.append(e)
    return out


@contextlib.contextmanager
def _behind_queue(backlog: Backlog) -> Iterator[None]:
    """The measured calls run behind about 100 ms of queued GPU work (no call waits for it); the
    deferred label checks read after them."""
    torch.cuda.synchronize()
    for _ in range(5):
        backlog.queue()
    try:
        yield
    finally:
        torch.cuda.synchronize()
        deferred_checks.raise_pending()


def inventory(call, backlog: Backlog, calls: int) -> dict:
    for _ in range(5):  # warm
        call()
    with _behind_queue(backlog), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
    top = _top_level(prof.events())
    host_us = collections.defaultdict(list)
    for e in top:
        host_us[e.name].append(e.cpu_time_total)
    rows = [
        {"name": name, "per_call": len(us) / calls, "host_us_median": round(statistics.median(us), 1)}
        for name, us in sorted(host_us.items(), key=lambda kv: -sum(kv[1]))
    ]
    kinds = collections.Counter("runtime" if e.name.startswith(_RUNTIME) else "op" for e in top)
    return {"per_call": {k: v / calls for k, v in kinds.items()}, "rows": rows}


_OURS = ("liger_patch/", "benchmarks/")  # the op's lines; for eager, the benchmark's own


def _ours_line(frame) -> str | None:
    """The innermost line of ``_OURS`` on the stack (``None``: the call came from elsewhere)."""
    while frame is not None:
        path = frame.f_code.co_filename
        for root in _OURS:
            if root in path:
                return f"{path.split(root)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def compiled_calls(call, backlog: Backlog, calls: int) -> dict:
    """Per call: the calls into compiled code from each line of ours (``_OURS``), by callee."""
    seen: collections.Counter = collections.Counter()

    def hook(frame, event, arg) -> None:
        if event == "c_call":
            line = _ours_line(frame)
            if line is not None:
                owner = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
                seen[line, f"{owner}.{arg.__name__}"] += 1

    # Every thread (Python >= 3.12): a CUDA backward runs on autograd's device thread.
    set_profile = getattr(threading, "setprofile_all_threads", sys.setprofile)
    with _behind_queue(backlog):
        set_profile(hook)
        try:
            for _ in range(calls):
                call()
        finally:
            set_profile(None)
    by_line = collections.defaultdict(dict)
    for (line, callee), n in sorted(seen.items()):
        by_line[line][callee] = n / calls
    return {"per_call": sum(seen.values()) / calls, "by_line": by_line}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="256,896,151936;1024,2048,128256")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    if not need_cuda("op_host_inventory.py"):
        return 2
    backlog = Backlog("cuda")
    result = {"device": torch.cuda.get_device_name(), "shapes": []}
    for shape in args.shapes.split(";"):
        n, h, v = (int(x) for x in shape.split(","))
        hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)
        row = {"N": n, "H": h, "V": v}
        for name, loss in zip(VARIANTS, (ours_loss, eager_loss), strict=True):
            call = functools.partial(fwd_bwd, loss, hidden, weight, labels)
            row[name] = inventory(call, backlog, args.calls)
            row[name]["compiled_calls"] = compiled_calls(call, backlog, args.calls)
        result["shapes"].append(row)
        counts = {k: {**row[k]["per_call"], "compiled": row[k]["compiled_calls"]["per_call"]}
                  for k in VARIANTS}  # fmt: skip
        print(json.dumps({"N": n, "H": h, "V": v, **counts}), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
