"""Probe: the host time of a signature's first calls, the graph's capture among them (issue 43).

The op with ``Tuning(call_graphs=True)``. A signature's calls: the first runs plainly, the
second captures the graph of its forward (``core/call_graph.py``) and replays it, the
later ones replay it (before b302839, ``plan_graph`` captured a call plan's
launches: the first is seen, the second makes the plan, the third runs it, the fourth captures).
At each ``--shapes`` N,H,V (bf16, 25 % of the labels ignored) with no plan or graph made before,
prints and writes to ``--out`` (JSON) each of its first ``--calls`` forward + backward calls'
host ms behind about 20 ms of queued GPU work (``host_bound.host_time``) and whether the GPU was
still busy with that work when the call returned (a call that waited for the GPU was not): the
capture's one-off cost, and whether it waits.

    python benchmarks/experiments/graph_capture_cost.py \
        --out benchmarks/experiments/results/graph_capture_cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import environment, fwd_bwd, make_inputs, need_cuda, write_json  # noqa: E402
from host_bound import Backlog, host_time, ours_with_graphs  # noqa: E402

from liger_patch.ops.core import deferred_checks  # noqa: E402
from liger_patch.ops.cross_entropy import one_chunk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes = ["256,896,151936", "1024,4096,32768", "512,2048,128256"]
    parser.add_argument("--shapes", nargs="+", default=shapes)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    if not need_cuda("graph_capture_cost.py"):
        raise SystemExit(2)
    backlog = Backlog("cuda")
    rows = []
    for shape in args.shapes:
        n, h, v = (int(x) for x in shape.split(","))
        hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.25, logit_std=3.0)

        def call() -> None:
            fwd_bwd(ours_with_graphs, hidden, weight, labels)  # noqa: B023 (called in this iteration)

        for measured in (False, True):  # a first round compiles the kernels, a second is measured
            one_chunk.forget()
            for i in range(1, args.calls + 1):
                ms, busy = host_time(call, backlog, "cuda")
                deferred_checks.raise_pending()
                if measured:
                    rows.append(
                        {"N": n, "H": h, "V": v, "call": i, "host_ms": round(ms, 3), "gpu_still_busy": busy}
                    )
                    print(json.dumps(rows[-1]), flush=True)
    write_json(args.out, {**environment(), "commit": args.commit, "rows": rows})


if __name__ == "__main__":
    main()
