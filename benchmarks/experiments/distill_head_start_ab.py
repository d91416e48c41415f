"""The distillation op with and without the teacher's head start (docs/perf-notes.md item 44).

At ``benchmarks/distill.py``'s three pairs, 2048 and 8192 tokens, nothing and 20 % of the labels
ignored (bf16, β 0.5, teacher correlation 0.9): fwd+bwd with the default ``Tuning`` against
``Tuning(head_start_gflop=0)``, in rotating order over ``--rounds`` rounds (``do_bench``
medians), the four-GEMM floor, and whether the two give the same loss and gradients bit for bit.

    PYTHONPATH=.:benchmarks python benchmarks/experiments/distill_head_start_ab.py \\
        --out benchmarks/experiments/results/distill_head_start_ab.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import distill  # noqa: E402
from common import bench, environment, write_json  # noqa: E402

VARIANTS = ("head", "no_head")


def variant_fn(name: str, t_h, t_w):
    import liger_patch as lp
    from liger_patch.ops.core.tuning import Tuning

    tuning = Tuning() if name == "head" else Tuning(head_start_gflop=0.0)

    def fn(s_h, s_w, labels):
        return lp.fused_linear_distillation(s_h, s_w, t_h, t_w, labels, beta=0.5, tuning=tuning)

    return fn


def results(fn, s_h, s_w, labels) -> list[torch.Tensor]:
    s_h.grad = s_w.grad = None
    loss = fn(s_h, s_w, labels)
    loss.backward()
    return [loss.detach().clone(), s_h.grad.clone(), s_w.grad.clone()]


def point_row(pair: int, tokens: int, ignore: float, rounds: int, rep_ms: int) -> dict:
    name, h_s, h_t, v = distill.PAIRS[pair]
    point = distill.DistillPoint(name, tokens, h_s, h_t, v)
    s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.bfloat16, ignore, 0.9, "cuda")
    fns = {name: variant_fn(name, t_h, t_w) for name in VARIANTS}
    outs = {name: results(fn, s_h, s_w, labels) for name, fn in fns.items()}  # each twice: the record
    outs = {name: results(fn, s_h, s_w, labels) for name, fn in fns.items()}
    same = all(torch.equal(a, b) for a, b in zip(outs["head"], outs["no_head"], strict=True))
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(rounds):
        for name in VARIANTS[r % 2 :] + VARIANTS[: r % 2]:
            fn = fns[name]

            def call(fn=fn):
                s_h.grad = s_w.grad = None
                fn(s_h, s_w, labels).backward()

            times[name].append(bench(call, rep_ms))
    floor = distill.time_floor(s_h.detach(), s_w.detach(), t_h, t_w, rep_ms)
    row = {"point": point.name, "ignore": ignore, "floor_ms": floor, "bit_equal": same}
    for name in VARIANTS:
        row[name] = {"ms": statistics.median(times[name]), "rounds": times[name]}
        row[name]["x_floor"] = row[name]["ms"] / floor
    print(
        f"{point.name} ignore {ignore}: head {row['head']['x_floor']:.3f} no_head "
        f"{row['no_head']['x_floor']:.3f} (floor {floor:.2f} ms) bit-equal {same}",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {**environment(), "beta": 0.5, "rounds": args.rounds, "rows": []}
    for tokens in (int(t) for t in args.tokens.split(",")):
        for ignore in (0.0, 0.2):
            for pair in range(len(distill.PAIRS)):
                out["rows"].append(point_row(pair, tokens, ignore, args.rounds, args.rep_ms))
                torch.cuda.empty_cache()
                if args.out:
                    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
