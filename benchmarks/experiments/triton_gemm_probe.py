"""Probe for the next performance step: can a Triton GEMM that also emits per-tile log-sum-exp
partials (so the row kernel's first pass disappears, or, for a lean mode, no logits are stored
at all) run as fast as cuBLAS's plain logits GEMM on this GPU?

Times, at one (N, H, V), the logits GEMM ``h W^T`` through cuBLAS (bf16 and fp32 output) and
through a Triton kernel that writes fp32 / bf16 / no logits plus (max, sum-exp) partials per
(row, vocab tile), for a few tile configurations; checks the partials against torch.

    python benchmarks/experiments/triton_gemm_probe.py \
        --out benchmarks/experiments/results/triton_gemm_probe.json

Stand-alone: its kernel is the probe's own (pointer loads, one tile per program), not the
library's ``ops/core/triton/logits.py``, which came later (docs/perf-notes.md items 8 and 19).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import bench as _bench  # noqa: E402
from common import need_cuda, write_json  # noqa: E402


@triton.jit
def _gemm_lse_partials(
    h_ptr, w_ptr, out_ptr, pmax_ptr, psum_ptr, M, V, K,
    WRITE: tl.constexpr, OUT_BF16: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(V, BN)
    in_group = GROUP_M * tiles_n
    group = pid // in_group
    first_m = group * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m

    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    h_tile = h_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(h_tile, mask=rows[:, None] < M, other=0.0)
        b = tl.load(w_tile, mask=cols[:, None] < V, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
        h_tile += BK
        w_tile += BK
    valid = (rows[:, None] < M) & (cols[None, :] < V)
    if WRITE:
        dst = out_ptr + rows[:, None].to(tl.int64) * V + cols[None, :]
        if OUT_BF16:
            tl.store(dst, acc.to(tl.bfloat16), mask=valid)
        else:
            tl.store(dst, acc, mask=valid)
    z = tl.where(valid, acc, float("-inf"))
    row_max = tl.max(z, axis=1)
    row_sum = tl.sum(tl.exp(z - row_max[:, None]), axis=1)
    part = rows.to(tl.int64) * tiles_n + pid_n
    tl.store(pmax_ptr + part, row_max, mask=rows < M)
    tl.store(psum_ptr + part, row_sum, mask=rows < M)


def run_triton(h, w, write: bool, out_bf16: bool, config: tuple[int, int, int, int, int]):
    bm, bn, bk, stages, warps = config
    m, k = h.shape
    v = w.shape[0]
    tiles_n = triton.cdiv(v, bn)
    out = (
        torch.empty(m, v, device=h.device, dtype=torch.bfloat16 if out_bf16 else torch.float32)
        if write
        else h
    )
    pmax = torch.empty(m * tiles_n, device=h.device)
    psum = torch.empty(m * tiles_n, device=h.device)
    grid = (triton.cdiv(m, bm) * tiles_n,)
    _gemm_lse_partials[grid](
        h, w, out, pmax, psum, m, v, k, WRITE=write, OUT_BF16=out_bf16,
        BM=bm, BN=bn, BK=bk, GROUP_M=8, num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out, pmax.view(m, tiles_n), psum.view(m, tiles_n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="8192,4096,128256")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/experiments/triton_gemm_probe.py"):
        return 2
    n, hd, v = (int(x) for x in args.shape.split(","))
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hd, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(v, hd, device="cuda", generator=gen) / hd**0.5).to(torch.bfloat16)
    flops = 2 * n * hd * v

    def bench(fn):
        return _bench(fn, 300)

    res = {"shape": [n, hd, v], "device": torch.cuda.get_device_name(), "triton": triton.__version__}
    res["cublas_bf16_out_ms"] = bench(lambda: h @ w.t())
    res["cublas_fp32_out_ms"] = bench(lambda: torch.mm(h, w.t(), out_dtype=torch.float32))
    ref_lse = torch.logsumexp(torch.mm(h[:256], w.t(), out_dtype=torch.float32), dim=1)
    res["triton"] = []
    for config in [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8)]:
        for write, out_bf16, name in [
            (True, False, "fp32_logits"),
            (True, True, "bf16_logits"),
            (False, False, "none"),
        ]:
            try:
                _, pmax, psum = run_triton(h[:256], w, write, out_bf16, config)
                lse = torch.logsumexp(pmax + psum.log(), dim=1)
                err = float((lse - ref_lse).abs().max())
                ms = bench(lambda c=config, wr=write, ob=out_bf16: run_triton(h, w, wr, ob, c))
                row = {
                    "config": config,
                    "logits": name,
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "lse_max_abs_err": err,
                }
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                row = {"config": config, "logits": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            res["triton"].append(row)
            print(json.dumps(row), flush=True)
    res["cublas_tflops"] = flops / res["cublas_bf16_out_ms"] / 1e9
    print(json.dumps({k: v for k, v in res.items() if k != "triton"}))
    if args.out:
        write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
