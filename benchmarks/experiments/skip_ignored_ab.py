"""Probe: what skipping ignored rows gains or costs, by the share of labels ignored.

At each shape and ignored share, the op (fwd+bwd, bf16, logit std 3) with
``Tuning(skip_ignored_share=0.0)`` (skip any ignored row: gather the kept ones) against
``Tuning(skip_ignored_share=1.0)`` (walk every row), timed in alternating rounds. Shares near 0
show the gathers' cost (one ignored label per 2048-token sequence is what a causal LM's label
shift leaves); the larger ones the saving (docs/perf-notes.md item 28).

    python benchmarks/experiments/skip_ignored_ab.py --out benchmarks/experiments/results/skip_ignored_ab.json
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import bench, environment, make_inputs, need_cuda, write_json  # noqa: E402

import liger_patch as lp  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402

SHAPES = ((8192, 4096, 128256), (4096, 2560, 262144), (16384, 896, 151936))
SHARES = (1 / 2048, 0.005, 0.02, 0.05, 0.2)
SETTINGS = {"skip": Tuning(skip_ignored_share=0.0), "all_rows": Tuning(skip_ignored_share=1.0)}


def measure(n: int, h: int, v: int, share: float, rounds: int, rep_ms: int) -> dict:
    """Both settings' ms at one shape and ignored share, alternating their order each round."""
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=share, logit_std=3.0)
    times = {name: [] for name in SETTINGS}
    for r in range(rounds):
        for name in list(SETTINGS)[:: 1 if r % 2 == 0 else -1]:

            def step(tuning=SETTINGS[name]):
                hidden.grad = weight.grad = None
                lp.fused_linear_cross_entropy(hidden, weight, labels, tuning=tuning).backward()

            times[name].append(bench(step, rep_ms))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "n": n,
        "h": h,
        "v": v,
        "ignored_share": share,
        "ms": times,
        "skip_vs_all_rows": med["skip"] / med["all_rows"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--shares", default=",".join(map(str, SHARES)), help="comma list of ignored shares")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not need_cuda("benchmarks/experiments/skip_ignored_ab.py"):
        return 2
    rows = []
    for n, h, v in SHAPES:
        for share in map(float, args.shares.split(",")):
            rows.append(measure(n, h, v, share, args.rounds, args.rep_ms))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        write_json(args.out, {**environment(), "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
