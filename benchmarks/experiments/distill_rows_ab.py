"""The distillation row kernel and the whole op under this checkout: one JSON line, for an A/B
run under two checkouts (docs/perf-notes.md item 43).

1. The row kernel alone on one 1024-row chunk of bf16 logits (V=128256, with the fused GEMM's
   partials but at β 1, gradient in place, coefficient 1/rows) for β 0.5, 0 and 1: median ms (the copy that
   restores the student's logits subtracted) and TB/s at the bytes its passes move; and its
   loss and gradient against an fp64 autograd reference on the same stored logits (max error
   over the largest value).
2. The whole op (fwd+bwd, β 0.5, nothing ignored) at ``benchmarks/distill.py``'s three pairs at
   8192 tokens, and the four-GEMM floor.

    for i in 1 2 3; do for p in base .; do
        PYTHONPATH=$p:benchmarks python benchmarks/experiments/distill_rows_ab.py --tag $p; done; done
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import distill  # noqa: E402
from common import bench  # noqa: E402

ROWS, HIDDEN, VOCAB = 1024, 2048, 128256
BYTES_PER_POSITION = {0.5: 10, 0.0: 6, 1.0: 10}  # docs/distillation.md (β 1 takes no partials)


def reference(s_logits, t_logits, beta: float, coef: float):
    """fp64 per-row divergence and coef * its gradient over the student's logits."""
    z_s = s_logits.double().requires_grad_(True)
    log_s = torch.log_softmax(z_s, dim=-1)
    log_t = torch.log_softmax(t_logits.double(), dim=-1)
    if beta == 0.0:
        div = (log_t.exp() * (log_t - log_s)).sum(-1)
    elif beta == 1.0:
        div = (log_s.exp() * (log_s - log_t)).sum(-1)
    else:
        log_m = torch.logaddexp(
            log_s + torch.log1p(torch.tensor(-beta)), log_t + torch.log(torch.tensor(beta))
        )
        div = beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1 - beta) * (
            log_s.exp() * (log_s - log_m)
        ).sum(-1)
    (grad,) = torch.autograd.grad(div.sum() * coef, z_s)
    return div.detach(), grad


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def row_kernel(rep_ms: int) -> dict:
    from liger_patch.ops.core.triton.logits import logits_with_partials
    from liger_patch.ops.distillation.options import build_distill_options
    from liger_patch.ops.distillation.triton import rows as kernel

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_s = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (3 / HIDDEN**0.5)).bfloat16()
    w_t = (
        0.9 * w_s.float() + torch.randn(VOCAB, HIDDEN, device="cuda", generator=gen) * (1.3 / HIDDEN**0.5)
    ).bfloat16()
    labels = torch.randint(0, VOCAB, (ROWS,), device="cuda", generator=gen)
    coef = torch.full((ROWS,), 1.0 / ROWS, device="cuda")
    s_logits = torch.empty(ROWS, VOCAB, device="cuda", dtype=torch.bfloat16)
    t_logits = torch.empty_like(s_logits)
    out = {}
    for beta in (0.5, 0.0, 1.0):
        opts = build_distill_options(beta=beta)
        partials = (
            logits_with_partials(x, w_s, None, opts.student, s_logits)[:2],
            logits_with_partials(x, w_t, None, opts.teacher, t_logits)[:2],
        )
        if beta == 1.0:  # its value comes from the online statistics pass
            partials = None
        s_copy = s_logits.clone()

        def run(opts=opts, partials=partials, s_copy=s_copy):
            s_logits.copy_(s_copy)
            return kernel.distill_rows_triton(
                s_logits, t_logits, labels, opts, grad=s_logits, coef=coef, partials=partials
            )

        copy_ms = bench(lambda s_copy=s_copy: s_logits.copy_(s_copy), rep_ms)
        ms = bench(run, rep_ms) - copy_ms
        loss = run()
        want_loss, want_grad = reference(s_copy, t_logits, beta, 1.0 / ROWS)
        out[str(beta)] = {
            "ms": ms,
            "tb_s": ROWS * VOCAB * BYTES_PER_POSITION[beta] / ms / 1e9,
            "loss_err": rel_err(loss, want_loss),
            "grad_err": rel_err(s_logits, want_grad),
        }
        del want_grad, s_copy
        torch.cuda.empty_cache()
    return out


def whole_op(rep_ms: int) -> dict:
    out = {}
    for pair, h_s, h_t, v in distill.PAIRS:
        point = distill.DistillPoint(pair, 8192, h_s, h_t, v)
        s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.bfloat16, 0.0, 0.9, "cuda")
        fn = distill.bound("ours", distill.Setting(teacher=(t_h, t_w)))

        def call(fn=fn, s_h=s_h, s_w=s_w, labels=labels):
            s_h.grad = s_w.grad = None
            fn(s_h, s_w, labels).backward()

        ms = bench(call, rep_ms)
        floor = distill.time_floor(s_h.detach(), s_w.detach(), t_h, t_w, rep_ms)
        out[point.name] = {"ms": ms, "floor_ms": floor, "x_floor": ms / floor}
        del s_h, s_w, labels, t_h, t_w, fn, call
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", required=True, help="names the checkout in the output line")
    p.add_argument("--rep-ms", type=int, default=500)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    line = {"tag": args.tag, "device": torch.cuda.get_device_name()}
    line["row_kernel"] = row_kernel(args.rep_ms)
    line["whole_op"] = whole_op(args.rep_ms)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
