"""Where the fused op's time goes: each stage of the chunk loop timed on its own, on one GPU.

Stages (summed over all chunks of N tokens): GEMM1 (logits, fp32 or bf16 out), the Triton row
kernel, GEMM2 (grad_h), GEMM3 (grad_W accumulated in fp32 or bf16), the backward's scaling,
the label check; then the whole op at several chunk budgets and row-kernel launch configs.
Used to decide the performance changes recorded in docs/perf-notes.md.

    python benchmarks/experiments/flce_breakdown.py --out benchmarks/experiments/results/flce_breakdown.json

The row-kernel launch configs are forced through ``Tuning(row_block=b, row_warps=((0, w),))``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import MiB, bench, need_cuda, write_json  # noqa: E402

from liger_patch import fused_linear_cross_entropy  # noqa: E402
from liger_patch.ops.core import validation  # noqa: E402
from liger_patch.ops.core.gemm import grad_view  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy.options import LossOptions  # noqa: E402
from liger_patch.ops.cross_entropy.triton.rows import ce_rows_triton  # noqa: E402


def stage_times(n: int, h_dim: int, v: int, rows: int, rep: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = (torch.randn(v, h_dim, device="cuda", generator=gen) / h_dim**0.5).to(torch.bfloat16)
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    coef = torch.full((n,), 1.0 / n, device="cuda")
    opts = LossOptions()
    chunks = [(s, min(s + rows, n)) for s in range(0, n, rows)]
    grad_logits = torch.randn(rows, v, device="cuda", generator=gen).to(torch.bfloat16) * 1e-4
    strided = torch.empty(rows, v, device="cuda", dtype=torch.float32)
    strided_grad = grad_view(strided, torch.bfloat16)
    strided_grad.copy_(grad_logits)
    grad_h = torch.empty_like(hidden)
    acc32 = torch.zeros(v, h_dim, device="cuda", dtype=torch.float32)
    acc16 = torch.empty(v, h_dim, device="cuda", dtype=torch.bfloat16)

    def g1_fp32():
        for s, e in chunks:
            torch.mm(hidden[s:e], weight.t(), out_dtype=torch.float32)

    def g1_bf16():
        for s, e in chunks:
            torch.mm(hidden[s:e], weight.t())

    def g1_and_row():
        for s, e in chunks:
            logits = torch.mm(hidden[s:e], weight.t(), out_dtype=torch.float32)
            g = grad_view(logits, torch.bfloat16)
            ce_rows_triton(logits, labels[s:e], opts, grad=g, coef_ce=coef[s:e], coef_z=coef[s:e])

    def g2():
        for s, e in chunks:
            torch.mm(strided_grad[: e - s], weight, out=grad_h[s:e])

    def g3_fp32():
        for s, e in chunks:
            torch.addmm(acc32, strided_grad[: e - s].t(), hidden[s:e], out_dtype=torch.float32, out=acc32)

    def g3_bf16():
        for i, (s, e) in enumerate(chunks):
            if i == 0:
                torch.mm(strided_grad[: e - s].t(), hidden[s:e], out=acc16)
            else:
                acc16.addmm_(strided_grad[: e - s].t(), hidden[s:e])

    scale = torch.tensor(1.0, device="cuda")

    def scale_grads():
        acc16.mul_(scale)
        grad_h.mul_(scale)

    def label_check():
        validation.check_values(labels, v, -100)

    out = {"rows_per_chunk": rows, "chunks": len(chunks)}
    for name, fn in [
        ("gemm1_fp32_out", g1_fp32),
        ("gemm1_bf16_out", g1_bf16),
        ("gemm1_plus_row_kernel", g1_and_row),
        ("gemm2_grad_h", g2),
        ("gemm3_grad_w_fp32_acc", g3_fp32),
        ("gemm3_grad_w_bf16_acc", g3_bf16),
        ("backward_scaling", scale_grads),
        ("label_check", label_check),
    ]:
        out[name] = bench(fn, rep)
    out["row_kernel"] = out["gemm1_plus_row_kernel"] - out["gemm1_fp32_out"]
    return out


def full_op(n: int, h_dim: int, v: int, budget_mib: int, launch: tuple[int, int] | None, rep: int) -> float:
    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(n, h_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = (torch.randn(v, h_dim, device="cuda", generator=gen) / h_dim**0.5).to(torch.bfloat16)
    weight.requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    tuning = Tuning() if launch is None else Tuning(row_block=launch[0], row_warps=((0, launch[1]),))

    def step():
        hidden.grad = weight.grad = None
        fused_linear_cross_entropy(
            hidden, weight, labels, memory_budget=budget_mib * MiB, tuning=tuning
        ).backward()

    step()
    return bench(step, rep)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8192,4096,128256")
    parser.add_argument("--rep-ms", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/experiments/flce_breakdown.py"):
        return 2
    n, h_dim, v = (int(x) for x in args.shape.split(","))
    result: dict = {"shape": [n, h_dim, v], "device": torch.cuda.get_device_name(), "stages": [], "op": []}
    for rows in (1024, 2048, 4096):
        result["stages"].append(stage_times(n, h_dim, v, rows, args.rep_ms))
        torch.cuda.empty_cache()
    for budget in (256, 512, 1024, 2048):
        result["op"].append({"budget_mib": budget, "ms": full_op(n, h_dim, v, budget, None, args.rep_ms)})
    for block, warps in ((2048, 8), (4096, 8), (4096, 16), (8192, 16), (16384, 16)):
        ms = full_op(n, h_dim, v, 512, (block, warps), args.rep_ms)
        result["op"].append({"budget_mib": 512, "block_v": block, "num_warps": warps, "ms": ms})
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
