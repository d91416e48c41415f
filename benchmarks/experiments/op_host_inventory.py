"""Probe: every host-side operation of one fused-loss forward + backward on CUDA, and where in
``liger_patch`` it is issued (issue 43, target 1).

At ``--shapes`` N,H,V (bf16, a quarter of the labels -100, logit std 3), warm, behind about 100 ms
of queued GPU work so that no call waits: ``torch.profiler`` (CPU and CUDA, with stacks) over
``--calls`` forward + backward calls of ours, then of eager's. Listed per call: each top-level
aten operator and each CUDA runtime / driver call (kernel launches, copies, events, syncs), with
its host µs and the innermost ``liger_patch`` line that issued it; and the totals by kind. A count
of what a call issues, to tell which of its operations could go. JSON to ``--out``.

    python benchmarks/experiments/op_host_inventory.py --out /tmp/inventory.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from common import fwd_bwd, make_inputs, need_cuda  # noqa: E402
from host_bound import Backlog, eager_loss, ours_loss  # noqa: E402

from liger_patch.ops.core import deferred_checks  # noqa: E402

_RUNTIME = ("cuda", "cu")  # cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync, cudaEventRecord, ...


def _where(event) -> str:
    frames = [f for f in (event.stack or []) if "liger_patch/" in f]
    return frames[0].split("liger_patch/")[-1] if frames else ""


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


def inventory(call, backlog: Backlog, calls: int) -> dict:
    for _ in range(5):
        call()
    deferred_checks.raise_pending()
    torch.cuda.synchronize()
    for _ in range(5):  # about 100 ms: no call waits for the GPU
        backlog.queue()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(calls):
            call()
    torch.cuda.synchronize()
    deferred_checks.raise_pending()
    top = _top_level(prof.events())
    items = [{"name": e.name, "host_us": round(e.cpu_time_total, 1), "where": _where(e)} for e in top]
    host_us = collections.defaultdict(list)
    for i in items:
        host_us[i["name"], i["where"]].append(i["host_us"])
    rows = [
        {"name": name, "where": where, "per_call": len(us) / calls, "host_us_median": statistics.median(us)}
        for (name, where), us in sorted(host_us.items(), key=lambda kv: -sum(kv[1]))
    ]
    kinds = collections.Counter("runtime" if i["name"].startswith(_RUNTIME) else "op" for i in items)
    return {"per_call": {k: v / calls for k, v in kinds.items()}, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="256,896,151936;1024,2048,128256")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    need_cuda("op_host_inventory.py")
    backlog = Backlog("cuda")
    result = {"device": torch.cuda.get_device_name(), "shapes": []}
    for shape in args.shapes.split(";"):
        n, h, v = (int(x) for x in shape.split(","))
        hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)
        row = {"N": n, "H": h, "V": v}
        for name, loss in (("ours", ours_loss), ("eager", eager_loss)):
            call = functools.partial(fwd_bwd, loss, hidden, weight, labels)
            row[name] = inventory(call, backlog, args.calls)
        result["shapes"].append(row)
        print(json.dumps({k: row[k] if k in "NHV" else row[k]["per_call"] for k in row}), flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
