"""Probe: where one traced step of a patched model differs from the unpatched one (issue 43, target 4).

Reads the chrome traces that ``zero3_gpu.py --trace DIR`` writes (``trace_{stage}_{row}_{variant}
_rank{r}.json.gz``, one step per variant and rank, from a synchronised start) and pairs each
variant's with the unpatched one of the same stage, row and rank. Per trace:

* ``span_ms``: from the step's first event to its last, host or GPU;
* ``gpu_busy_ms``: the union of every kernel's and copy's interval (any stream), and the kernels
  summed by kind (``nccl`` and ``compute``), with ``gpu_idle_ms`` the span's rest;
* ``host_wait_ms``: the host's ms inside the CUDA calls that wait for the GPU, by call;
* ``host_self_ms``: the self time (its duration less its children's) of every host event
  (operators, runtime calls, annotations), summed by name over the step's threads;
* ``annotations``: the annotated host ranges (the optimizer's step, DeepSpeed's), ms by name.

Then the differences, patched minus unpatched: the totals, the host events whose self ms differ
most, the kernels whose summed ms differ most. A step whose GPU is idle for most of its span is
bound by its host: there its host self ms are what to compare.

    python benchmarks/experiments/trace_diff.py DIR --out diff.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy ")
_NAME = re.compile(r"trace_(?P<stage>[^_]+)_(?P<row>.+)_(?P<variant>[^_]+)_rank(?P<rank>\d+)\.json(\.gz)?$")
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e3


def _self_ms(host: list[dict]) -> collections.Counter:
    """Self µs by name: each event's duration less that of the events nested in it, per thread."""
    by_thread = collections.defaultdict(list)
    for e in host:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: collections.Counter = collections.Counter()
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, child µs]
        for e in events:
            while stack and e["ts"] >= stack[-1][0]:
                end, name, child, dur = stack.pop()
                out[name] += dur - child
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"][:80], 0.0, e["dur"]])
        for _, name, child, dur in stack:
            out[name] += dur - child
    return collections.Counter({k: v / 1e3 for k, v in out.items()})


def summarise(path: Path) -> dict:
    events = _events(path)
    gpu = [e for e in events if e.get("cat") in _GPU_CATS]
    host = [e for e in events if e.get("cat") not in _GPU_CATS and e.get("cat") != "ac2g"]
    start = min(e["ts"] for e in events)
    stop = max(e["ts"] + e["dur"] for e in events)
    kernels = collections.Counter()
    kinds = collections.Counter()
    for e in gpu:
        kernels[e["name"][:90]] += e["dur"] / 1e3
        kinds["nccl" if "nccl" in e["name"].lower() else "compute"] += e["dur"] / 1e3
    busy = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    self_ms = _self_ms(host)
    waits = {name: ms for name, ms in self_ms.items() if name.startswith(HOST_WAITS)}
    notes = collections.Counter()
    for e in host:
        if e.get("cat") == "user_annotation":
            notes[e["name"][:80]] += e["dur"] / 1e3
    return {
        "span_ms": (stop - start) / 1e3,
        "gpu_busy_ms": busy,
        "gpu_idle_ms": (stop - start) / 1e3 - busy,
        "kernel_ms": dict(kinds),
        "host_wait_ms": waits,
        "host_self_total_ms": sum(self_ms.values()),
        "annotations": dict(notes.most_common(20)),
        "_self": self_ms,
        "_kernels": kernels,
    }


def _largest(a: collections.Counter, b: collections.Counter, n: int) -> dict:
    diff = {k: round(b.get(k, 0.0) - a.get(k, 0.0), 3) for k in set(a) | set(b)}
    return dict(sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:n])


def compare(folder: Path, top: int) -> list[dict]:
    traces = {}
    for path in sorted(folder.glob("trace_*.json*")):
        m = _NAME.match(path.name)
        if m:
            traces[(m["stage"], m["row"], m["rank"], m["variant"])] = summarise(path)
    rows = []
    for (stage, row, rank, variant), s in sorted(traces.items()):
        base = traces.get((stage, row, rank, "unpatched"))
        if variant == "unpatched" or base is None:
            continue
        keys = ("span_ms", "gpu_busy_ms", "gpu_idle_ms", "host_self_total_ms")
        rows.append({
            "stage": stage, "row": row, "rank": int(rank), "variant": variant,
            "unpatched": {k: v for k, v in base.items() if not k.startswith("_")},
            "patched": {k: v for k, v in s.items() if not k.startswith("_")},
            "patched_minus_unpatched": {k: round(s[k] - base[k], 3) for k in keys},
            "host_self_largest_differences": _largest(base["_self"], s["_self"], top),
            "kernel_largest_differences": _largest(base["_kernels"], s["_kernels"], top),
        })  # fmt: skip
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = compare(args.folder, args.top)
    text = json.dumps({"rows": rows}, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    for r in rows:
        print(json.dumps({k: r[k] for k in ("stage", "row", "rank", "variant", "patched_minus_unpatched")}))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
