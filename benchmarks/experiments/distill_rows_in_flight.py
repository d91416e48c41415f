"""The distillation row kernel's rows in flight: one program per row against a grid of fewer
programs that each walk several rows, so that the rows being read fit the L2 and the mixture's
second read of both logits (docs/perf-notes.md, the distillation bound) comes from it.

One chunk of 1024 rows at V = 128256 and 151936 (bf16 logits of std 3, teacher correlation 0.9),
beta 0.5 with the statistics as partials (what the op passes on Hopper: one (max, sum) tile per
row here), the gradient into a bf16 buffer of its own; ``triton.testing.do_bench`` medians
for each grid size, and the bytes the two passes read and write (10 a position) over that time.

    python benchmarks/experiments/distill_rows_in_flight.py \\
        --out benchmarks/experiments/results/distill_rows_in_flight.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton

from liger_patch.ops.distillation_options import build_distill_options
from liger_patch.ops.triton.distill import distill_rows_triton

ROWS = 1024
GRIDS = (None, 1056, 792, 528, 396, 264, 132, 66)  # None: one program per row


def sweep(vocab: int, opts) -> list[dict]:
    """Each grid size's kernel time on one chunk at ``vocab``, and whether its results are the
    one-program-per-row grid's, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    zs = torch.randn(ROWS, vocab, device="cuda", generator=gen) * 3
    zt = 0.9 * zs + (1 - 0.81) ** 0.5 * 3 * torch.randn(ROWS, vocab, device="cuda", generator=gen)
    xs, xt = zs.bfloat16(), zt.bfloat16()
    del zs, zt
    partials = []
    for x in (xs, xt):
        top = x.float().amax(1, keepdim=True)
        partials.append((top, (x.float() - top).exp().sum(1, keepdim=True)))
    labels = torch.randint(0, vocab, (ROWS,), device="cuda", generator=gen)
    coef = torch.full((ROWS,), 1.0 / ROWS, device="cuda")
    grad = torch.empty_like(xs)
    out, reference = [], None
    for grid in GRIDS:
        call = functools.partial(
            distill_rows_triton,
            xs,
            xt,
            labels,
            opts,
            grad=grad,
            coef=coef,
            partials=tuple(partials),
            programs=grid,
        )
        loss = call()
        if reference is None:
            reference = (loss.clone(), grad.clone())
        same = bool(torch.equal(loss, reference[0]) and torch.equal(grad, reference[1]))
        ms = triton.testing.do_bench(call, warmup=50, rep=500)
        tb_s = 10 * ROWS * vocab / ms / 1e9
        out.append(
            {"vocab": vocab, "programs": grid or ROWS, "kernel_ms": ms, "tb_s": tb_s, "bit_equal": same}
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    opts = build_distill_options(beta=0.5)
    rows = [row for vocab in (128256, 151936) for row in sweep(vocab, opts)]
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
