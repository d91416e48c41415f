"""Probe: host time of the fused loss with its loss reduced as one dot product with the row
weights (``reduction.weighted_total``, the op's path) against the sum, divide and poison multiply it
replaced, in one process (issue 43).

The variants alternate (order reversed every other round) over ``--rounds`` rounds; each round
times ten forward + backward calls in a row behind about 100 ms of queued GPU work
(``host_bound.steady_host_ms``: a host that never waits). bf16, no label ignored (the call never
waits to skip). Prints and appends to ``--out`` a JSON line per shape: µs per call, the median over
rounds per variant.

    python benchmarks/experiments/loss_reduction_ab.py --out /tmp/loss_reduction_ab.jsonl
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common, host_bound
from common import append_jsonl, fwd_bwd, make_inputs, need_cuda  # noqa: E402
from host_bound import Backlog, ours_loss, steady_host_ms  # noqa: E402

from liger_patch.ops.core.reduction import reduce_rows  # noqa: E402
from liger_patch.ops.cross_entropy import operator  # noqa: E402


def sum_divide_multiply(call, res, checked):
    """The loss and z-loss as the op reduced them before (reduction "mean"/"sum", no z-loss)."""
    loss = reduce_rows(res.ce, call.opts.reduction, checked.divisor)
    z_loss = torch.zeros_like(loss)
    if checked.poison is not None:
        loss, z_loss = loss * checked.poison, z_loss * checked.poison
    return loss, z_loss


VARIANTS = {"dot": operator._losses, "sum_divide_multiply": sum_divide_multiply}


def measure(n: int, h: int, v: int, rounds: int, backlog: Backlog) -> dict:
    hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.0, logit_std=3.0)
    call = functools.partial(fwd_bwd, ours_loss, hidden, weight, labels)
    us: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        for i in range(rounds):
            for name in VARIANTS if i % 2 == 0 else reversed(VARIANTS):
                operator._losses = VARIANTS[name]
                call(), call()
                us[name].append(1e3 * steady_host_ms(call, backlog))
    finally:
        operator._losses = VARIANTS["dot"]
    return {"N": n, "H": h, "V": v, **{f"{k}_us": round(statistics.median(t), 1) for k, t in us.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["256,896,151936", "1024,2048,128256"])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    backlog = Backlog("cuda")
    for shape in args.shapes:
        row = measure(*map(int, shape.split(",")), args.rounds, backlog)
        append_jsonl(args.out, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
