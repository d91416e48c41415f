"""The head start (``ops/core/head_start.py``, perf-notes item 37) on and off, in one process.

At grid heads, fwd+bwd, rotated over ``--rounds``, for each share of ignored labels:
``ours`` (the default: the first chunk's logits GEMM begun before the label check's wait),
``ours_no_head`` (``Tuning(head_start_gflop=0)``: the wait first, as before item 37) and, at
0 % ignored, ``ours_no_sync`` (the label check trusted, no wait at all: ``host_sync_ab.py``'s
ceiling). With 20 % ignored the head is dropped (the call skips rows): there it must cost
nothing. Each point also checks that ``ours`` and ``ours_no_head`` give the same loss and
gradients bit for bit.

    python benchmarks/experiments/head_start_ab.py --out benchmarks/experiments/results/head_start_ab.json
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flce  # noqa: E402
from common import environment, fwd_bwd, make_inputs, time_floor, write_json  # noqa: E402
from host_sync_ab import CE_POINTS, _unsynced, rotated_medians  # noqa: E402

from liger_patch.ops.core.tuning import Tuning  # noqa: E402

NO_HEAD = Tuning(head_start_gflop=0.0)


def _no_head(hidden, weight, labels, softcap=None):
    return flce.ours(hidden, weight, labels, softcap, tuning=NO_HEAD)


def _bits(fn, hidden, weight, labels) -> list[torch.Tensor]:
    loss = fwd_bwd(fn, hidden, weight, labels)
    return [loss.detach().clone(), hidden.grad.clone(), weight.grad.clone()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=150)
    p.add_argument("--ignore-fracs", default="0.0,0.2")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {"environment": environment(), "rounds": args.rounds, "rep_ms": args.rep_ms, "rows": []}
    for frac in (float(f) for f in args.ignore_fracs.split(",")):
        for n, h, v in CE_POINTS:
            hidden, weight, labels = make_inputs(n, h, v, logit_std=3.0, ignore_frac=frac)
            fns = {"ours": flce.ours, "ours_no_head": _no_head}
            if frac == 0.0:
                fns["ours_no_sync"] = _unsynced(flce.ours)
            with_head, without = (_bits(fn, hidden, weight, labels) for fn in (flce.ours, _no_head))
            same = all(torch.equal(a, b) for a, b in zip(with_head, without, strict=True))
            row = {"N": n, "H": h, "V": v, "ignore_frac": frac, "bit_equal": same}
            floor = functools.partial(time_floor, hidden.detach(), weight.detach(), args.rep_ms)
            row.update(rotated_medians(fns, (hidden, weight, labels), floor, args.rounds, args.rep_ms))
            print({k: (x["x_floor"] if isinstance(x, dict) else x) for k, x in row.items()}, flush=True)
            result["rows"].append(row)
            write_json(args.out, result)
            del hidden, weight, labels
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
