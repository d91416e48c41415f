"""Chunking experiments behind the memory budget and the ``Tuning`` knobs (docs/perf-notes.md), on one GPU.

Default mode (``budget_sweep``), for each shape: the three-GEMM floor, then the whole op
(fwd+bwd, bf16) at several memory budgets with logits chunks stored in fp32 or in the input
dtype, and a prototype of the vocabulary-chunked gradient pass (token chunks give grad_h;
vocabulary chunks recompute the logits and give each grad_W block in one GEMM with K = N, so
grad_W is never re-read). The other modes time the whole op under ``Tuning`` settings,
interleaved so that clock drift hits every setting alike:

    python benchmarks/experiments/chunk_sweep.py --out benchmarks/experiments/results/chunk_sweep.json
    python benchmarks/experiments/chunk_sweep.py --rows 1024,1536,1664,2048 --shapes 32768x4096x151936 \
        --rounds 1 --out ...                                               # Tuning.chunk_rows (any NxHxV)
    python benchmarks/experiments/chunk_sweep.py --reverse-ab --out ...   # Tuning.reverse_pass2
    python benchmarks/experiments/chunk_sweep.py --launch-ab --out ...    # Tuning.row_block / row_warps
    python benchmarks/experiments/chunk_sweep.py --fused-ab --out ...     # Tuning.fused_logits

``--out`` sets only the mode's key (``budget_sweep``, ``row_count_sweep``, ``pass2_direction_ab``,
``launch_ab``, ``fused_ab``) in the file, keeping the others.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import (  # noqa: E402
    SHAPES,
    MiB,
    bench,
    extra_memory_mib,
    fwd_bwd,
    make_inputs,
    need_cuda,
    time_floor,
    update_json,
)

from liger_patch import fused_linear_cross_entropy  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy.backends import row_backend  # noqa: E402
from liger_patch.ops.cross_entropy.chunks import run_chunks  # noqa: E402
from liger_patch.ops.cross_entropy.options import LossOptions  # noqa: E402


def op_with(budget_mib: int, input_dtype_logits: bool):
    def fn(hidden, weight, labels):
        return fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            memory_budget=budget_mib * MiB,
            logits_dtype=None if input_dtype_logits else torch.float32,
        )

    return fn


@torch.no_grad()
def vocab_pass_prototype(hidden, weight, labels, budget_mib: int):
    """grad_h from token chunks, then grad_W block by block from recomputed (N, Vc) logits."""
    n, _ = hidden.shape
    v = weight.shape[0]
    opts = LossOptions(tuning=Tuning(two_pass=False))  # token chunks even below 512 rows
    backend = row_backend("triton", hidden.device)
    ce_rows_triton = backend.row_kernel
    coef = torch.full((n,), 1.0 / n, device="cuda")
    res = run_chunks(
        backend,
        hidden,
        weight,
        None,
        labels,
        opts,
        budget_bytes=budget_mib * MiB,
        coef_ce=coef,
        coef_z=coef,
        need_hidden=True,
    )
    grad_w = torch.empty_like(weight)
    cols = max(128, (budget_mib * MiB // (2 * n)) // 128 * 128)
    for v0 in range(0, v, cols):
        v1 = min(v0 + cols, v)
        logits = hidden @ weight[v0:v1].t()
        # Timing stand-in for the offset-aware gradient kernel: same bytes, same row lengths.
        ce_rows_triton(logits, labels, opts, grad=logits, coef_ce=coef, coef_z=coef, lse_in=res.lse)
        torch.mm(logits.t(), hidden, out=grad_w[v0:v1])
    return res.grad_hidden, grad_w


def gemm_efficiency(hidden, weight, rep: int) -> dict:
    """Per-chunk GEMM2 (grad_h, K = V) and GEMM3 (grad_W += g^T h, K = rows) summed over N,
    against the same GEMM at full N: how much chunking itself costs cuBLAS."""
    n = hidden.shape[0]
    out = {}
    for rows in (512, 1024, 2048, 4096):
        if rows > n:
            continue
        g = torch.randn(rows, weight.shape[0], device="cuda", dtype=hidden.dtype) * 1e-3
        gh = torch.empty(rows, hidden.shape[1], device="cuda", dtype=hidden.dtype)
        acc = torch.empty_like(weight)
        reps = n // rows

        def g2(g=g, gh=gh, reps=reps):
            for _ in range(reps):
                torch.mm(g, weight, out=gh)

        def g3(g=g, acc=acc, reps=reps, rows=rows):
            torch.mm(g.t(), hidden[:rows], out=acc)
            for _ in range(reps - 1):
                acc.addmm_(g.t(), hidden[:rows])

        out[str(rows)] = {"gemm2_ms": bench(g2, rep), "gemm3_ms": bench(g3, rep)}
        del g, gh, acc
    gfull = torch.randn(n, weight.shape[0], device="cuda", dtype=hidden.dtype) * 1e-3
    out["full"] = {
        "gemm2_ms": bench(lambda: gfull @ weight, rep),
        "gemm3_ms": bench(lambda: gfull.t() @ hidden, rep),
    }
    return out


def sweep_shape(name: str, budgets: list[int], rep: int) -> dict:
    n, h, v = SHAPES[name] if name in SHAPES else map(int, name.split("x"))  # or any "NxHxV"
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, 0.0)
    floor = time_floor(hidden.detach(), weight.detach(), rep)
    row = {"shape": name, "floor_ms": floor, "op": {}, "vocab_pass": {}}
    row["gemm_chunks"] = gemm_efficiency(hidden.detach(), weight.detach(), rep)
    torch.cuda.empty_cache()
    print(name, json.dumps(row["gemm_chunks"]), flush=True)
    for logits32 in (False, True):
        for b in budgets:
            fn = op_with(b, not logits32)
            fwd_bwd(fn, hidden, weight, labels)
            ms = bench(lambda fn=fn: fwd_bwd(fn, hidden, weight, labels), rep)
            mem = extra_memory_mib(fn, hidden, weight, labels)
            key = f"{'fp32' if logits32 else 'input'}_logits_{b}MiB"
            row["op"][key] = {"ms": ms, "x_floor": ms / floor, "extra_mib": mem}
            print(name, key, f"{ms:.2f} ms {ms / floor:.3f}x {mem:.0f} MiB", flush=True)
            hidden.grad = weight.grad = None
            torch.cuda.empty_cache()
    h0, w0 = hidden.detach(), weight.detach()
    for b in budgets:
        vocab_pass_prototype(h0, w0, labels, b)
        ms = bench(lambda b=b: vocab_pass_prototype(h0, w0, labels, b), rep)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        grads = vocab_pass_prototype(h0, w0, labels, b)
        torch.cuda.synchronize()
        mem = (torch.cuda.max_memory_allocated() - base - sum(t.numel() * 2 for t in grads)) / MiB
        row["vocab_pass"][f"{b}MiB"] = {"ms": ms, "x_floor": ms / floor, "extra_mib": mem}
        print(name, f"vocab_pass_{b}MiB {ms:.2f} ms {ms / floor:.3f}x {mem:.0f} MiB", flush=True)
    return row


def compare_settings(name: str, rep: int, tunings: dict[str, Tuning], rounds: int) -> dict:
    """The whole op (default options) with each of ``tunings`` in turn, rounds interleaved
    (A/B/A/B) so that clock drift hits every setting alike. Returns per-setting medians over the
    rounds and every time."""
    n, h, v = SHAPES[name] if name in SHAPES else map(int, name.split("x"))  # or any "NxHxV"
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, 0.0)
    times: dict[str, list[float]] = {label: [] for label in tunings}
    for _ in range(rounds):
        for label, tuning in tunings.items():

            def fn(hidden, weight, labels, tuning=tuning):
                return fused_linear_cross_entropy(hidden, weight, labels, tuning=tuning)

            fwd_bwd(fn, hidden, weight, labels)
            times[label].append(bench(lambda fn=fn: fwd_bwd(fn, hidden, weight, labels), rep))
    medians = {k: sorted(t)[len(t) // 2] for k, t in times.items()}
    print(name, json.dumps(medians), flush=True)
    return {"shape": name, "ms": medians, "all": times}


def reverse_pass_ab(name: str, rep: int) -> dict:
    """The row kernel's pass 2 backwards vs forwards (``Tuning.reverse_pass2``), three rounds."""
    tunings = {"backwards": Tuning(reverse_pass2=True), "forwards": Tuning(reverse_pass2=False)}
    return compare_settings(name, rep, tunings, 3)


def rows_sweep(name: str, rows_list: list[int], rep: int, rounds: int = 1) -> dict:
    """The token-chunk row count forced (``Tuning.chunk_rows``), ignoring the budget: how the row
    count (GEMM wave quantisation, grad_W passes) moves the time. ``rounds`` interleaved."""
    res = compare_settings(name, rep, {str(r): Tuning(chunk_rows=r) for r in rows_list}, rounds)
    return {"shape": name, "rows_ms": res["ms"], "all": res["all"]}


LAUNCHES = ((2048, 4), (4096, 8), (8192, 16), (16384, 16), (4096, 4))


def launch_ab(name: str, rep: int) -> dict:
    """The row kernel's (block, warps) forced to each of ``LAUNCHES`` (``Tuning.row_block`` and
    ``row_warps``), two rounds."""
    tunings = {f"{b}x{w}": Tuning(row_block=b, row_warps=((0, w),)) for b, w in LAUNCHES}
    return compare_settings(name, rep, tunings, 2)


def fused_logits_ab(name: str, rep: int) -> dict:
    """The logits GEMM with log-sum-exp partials (Triton) vs cuBLAS plus the row kernel's first
    pass (``Tuning.fused_logits``), three rounds."""
    return compare_settings(name, rep, {"fused": Tuning(), "cublas": Tuning(fused_logits=False)}, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="all")
    parser.add_argument("--budgets", default="32,64,128,256,512,1024")
    parser.add_argument("--rep-ms", type=int, default=600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--reverse-ab", action="store_true", help="only the pass-2 direction A/B")
    parser.add_argument("--rows", default=None, help="comma list: only the forced-row-count sweep")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of the forced-row-count sweep")
    parser.add_argument("--launch-ab", action="store_true", help="only the row-kernel launch-config A/B")
    parser.add_argument("--fused-ab", action="store_true", help="only the fused-logits-GEMM vs cuBLAS A/B")
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/experiments/chunk_sweep.py"):
        return 2
    shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    budgets = [int(b) for b in args.budgets.split(",")]
    if args.rows:
        rows_list = [int(r) for r in args.rows.split(",")]
        key, run = "row_count_sweep", lambda name: rows_sweep(name, rows_list, args.rep_ms, args.rounds)
    elif args.fused_ab:
        key, run = "fused_ab", lambda name: fused_logits_ab(name, args.rep_ms)
    elif args.launch_ab:
        key, run = "launch_ab", lambda name: launch_ab(name, args.rep_ms)
    elif args.reverse_ab:
        key, run = "pass2_direction_ab", lambda name: reverse_pass_ab(name, args.rep_ms)
    else:
        key, run = "budget_sweep", lambda name: sweep_shape(name, budgets, args.rep_ms)
    rows = []
    for name in shapes:
        rows.append(run(name))
        torch.cuda.empty_cache()
        if args.out:  # after every shape, so that a cut-off run keeps what it measured
            update_json(args.out, key, rows, device=torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
