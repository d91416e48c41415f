"""Probe: GPU time of one call with and without the op's own graphs (issue 43, target 2).

``graphed_call_bound.py`` at 992ead4 found the op's synchronised wall time 0.1-0.4 ms longer with
its graphs (then ``plan_graph``, now ``call_graph``) than without, though its host time was
shorter. This tells a slower GPU side (the replayed kernels, or the copies into the graph's
inputs) from the order in which the host submits the work: at each ``--shapes`` N,H,V (bf16, 25 %
ignored), after each variant's first 8 calls (its graph captured), ``--reps`` alternated forward +
backward calls of the op with ``Tuning(call_graphs=True)`` and with ``Tuning(call_graphs=False)``,
each timed from an idle GPU by CUDA events recorded before and after it (GPU ms from the first
launch's start to the last one's end, idle gaps included) and by the host's clock around it with a
sync after (wall ms). Medians, written to ``--out`` (JSON).

    python benchmarks/experiments/graph_gpu_time.py --out benchmarks/experiments/results/graph_gpu_time.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import environment, fwd_bwd, make_inputs, need_cuda, write_json  # noqa: E402
from host_bound import ours_ungraphed, ours_with_graphs  # noqa: E402

from liger_patch.ops.core import deferred_checks  # noqa: E402


def _timed(fn, hidden, weight, labels) -> tuple[float, float]:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fwd_bwd(fn, hidden, weight, labels)
    end.record()
    torch.cuda.synchronize()
    wall = 1e3 * (time.perf_counter() - t0)
    deferred_checks.raise_pending()
    return start.elapsed_time(end), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["256,896,151936", "1024,4096,32768"])
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if not need_cuda("graph_gpu_time.py"):
        raise SystemExit(2)
    rows = []
    variants = {"ours": ours_with_graphs, "ours_ungraphed": ours_ungraphed}
    for shape in args.shapes:
        n, h, v = (int(x) for x in shape.split(","))
        hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)
        for fn in variants.values():
            for _ in range(8):
                _timed(fn, hidden, weight, labels)
        gpu, wall = ({k: [] for k in variants} for _ in range(2))
        for _ in range(args.reps):
            for name, fn in variants.items():
                g, w = _timed(fn, hidden, weight, labels)
                gpu[name].append(g)
                wall[name].append(w)
        row = {"N": n, "H": h, "V": v, "ignored": 0.25}
        for name in variants:
            row[f"{name}_gpu_ms"] = round(statistics.median(gpu[name]), 4)
            row[f"{name}_wall_ms"] = round(statistics.median(wall[name]), 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_json(args.out, {**environment(), "commit": args.commit, "rows": rows})


if __name__ == "__main__":
    main()
