"""Probe: when a forward should wait for its label check to skip the ignored rows (issue 43).

Since issue 43 a forward on CUDA waits for its label check only when skipping the ignored rows
saves at least ``Tuning.wait_to_skip_gflop`` of GEMMs; otherwise it walks every row and the
host keeps its lead. At each shape and ignored share, fwd+bwd (bf16, logit std 3) with that
threshold at 0 (wait whenever rows could be skipped: the behaviour before), at the default and
at inf (never wait), plus the three-GEMM floor, each:

* ``*_ms``: median GPU-bound time of back-to-back calls (``triton.testing.do_bench``, the grid's
  measure: the host runs ahead, so a call that does not wait finds its check unanswered);
* ``*_host_ms``: host time of one call behind about 20 ms of queued GPU work (host_bound.py's).

    python benchmarks/experiments/wait_to_skip_ab.py --out benchmarks/experiments/results/wait_to_skip_ab.json
"""

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import bench, environment, make_inputs, need_cuda, time_floor, write_json  # noqa: E402
from host_bound import Backlog, host_time  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core import deferred_checks  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402

HEADS = ((896, 151936), (2048, 128256), (4096, 128256))
TOKENS = (1024, 2048, 4096, 8192, 16384)
SHARES = (0.0, 0.2)
SETTINGS = {
    "wait": Tuning(wait_to_skip_gflop=0.0),
    "default": Tuning(),
    "never": Tuning(wait_to_skip_gflop=math.inf),
}


def host_ms(step, backlog: Backlog, reps: int) -> float:
    """Median host ms of ``step`` behind the backlog (``host_bound.host_time``); the checks it
    deferred read after each."""
    times = []
    for _ in range(reps):
        times.append(host_time(step, backlog, "cuda")[0])
        deferred_checks.raise_pending()
    return statistics.median(times)


def measure(n: int, h: int, v: int, share: float, backlog: Backlog, rep_ms: int) -> dict:
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=share, logit_std=3.0)
    row = {"N": n, "H": h, "V": v, "ignored": share, "floor_ms": time_floor(hidden, weight, rep_ms)}
    for name, tuning in SETTINGS.items():

        def step(tuning=tuning):
            hidden.grad = weight.grad = None
            lp.fused_linear_cross_entropy(hidden, weight, labels, tuning=tuning).backward()

        step()
        row[f"{name}_ms"] = bench(step, rep_ms)
        deferred_checks.raise_pending()
        row[f"{name}_host_ms"] = host_ms(step, backlog, 7)
    for name in SETTINGS:
        row[f"{name}_over_floor"] = row[f"{name}_ms"] / row["floor_ms"]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    backlog, rows = Backlog("cuda"), []
    for h, v in HEADS:
        for n in TOKENS:
            for share in SHARES:
                rows.append(measure(n, h, v, share, backlog, args.rep_ms))
                shown = {k: round(x, 3) if isinstance(x, float) else x for k, x in rows[-1].items()}
                print(shown, flush=True)
                torch.cuda.empty_cache()
                if args.out:
                    write_json(args.out, {**environment("triton"), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
