"""grad_W's per-chunk GEMM: what its read and write of the accumulator cost, and whether cuBLASLt
or another kernel choice hides them (docs/perf-notes.md, items 33 and 41).

At heads where the op trails torch.compile with nothing to skip, with the token chunk the default
budget plans there, bf16: ``acc.addmm_(g.t(), h)`` (what
``grad_weight_layout.accumulate_grad_weight`` runs for every chunk after the first) against
``torch.mm(g.t(), h, out=acc)`` (the first chunk's overwrite: no read of the accumulator), and
the same sum kept transposed (H x V, ``accT.addmm_(h.t(), g)``: another kernel for the same
product), each under cuBLAS and under cuBLASLt (``torch.backends.cuda.preferred_blas_library``);
and one GEMM over all the tokens (the floor's). ``triton.testing.do_bench`` medians, per chunk and
summed over a call's chunks.

    python benchmarks/experiments/grad_w_gemm_ab.py \\
        --out benchmarks/experiments/results/grad_w_gemm_ab.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

# (N, H, V, rows a chunk at the default budget, bf16)
HEADS = (
    (4096, 2560, 262144, 768),
    (4096, 2880, 201088, 1024),
    (8192, 3584, 152064, 1536),
    (4096, 1152, 262144, 768),
)


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=300)


def chunk_times(acc: torch.Tensor, g: torch.Tensor, hid: torch.Tensor) -> dict:
    """One chunk's grad_W GEMM each way, under each BLAS library."""
    acc_t = acc.view(acc.shape[1], acc.shape[0])
    out = {}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        out[f"addmm_{library}_ms"] = timed(lambda: acc.addmm_(g.t(), hid))
        out[f"mm_{library}_ms"] = timed(lambda: torch.mm(g.t(), hid, out=acc))
        out[f"addmm_t_{library}_ms"] = timed(lambda: acc_t.addmm_(hid.t(), g))
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def head_row(n: int, h: int, v: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    acc = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3
    row = {"N": n, "H": h, "V": v, "rows": rows, "chunks": -(-n // rows)}
    row |= chunk_times(acc, g, torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, generator=gen))
    g = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3
    h_all = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    row["one_gemm_ms"] = timed(lambda: torch.mm(g.t(), h_all, out=acc))
    for library in ("cublas", "cublaslt"):  # the last chunk's share counted pro rata
        row[f"call_{library}_ms"] = row[f"mm_{library}_ms"] + row[f"addmm_{library}_ms"] * (n / rows - 1)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for head in HEADS:
        rows.append(head_row(*head))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
