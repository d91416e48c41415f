"""grad_W's per-chunk GEMM in Triton: can a persistent kernel that adds each tile of the
accumulator in its own epilogue hide the read and write that cuBLAS's ``addmm_`` pays
(docs/perf-notes.md, items 33, 41 and 42)?

``C (+)= G^T X`` with G a token chunk's logits gradient (rows x V, bf16, as the row kernel leaves
it), X the chunk's hidden states (rows x H) and C grad_W's running sum (V x H, bf16). The kernel
walks (V, H) output tiles on a persistent grid, loads G and X through TMA descriptors (G's
tiles transposed in shared memory), and either starts each tile's fp32 accumulator from C
(``c_first``: the read is issued before the tile's mainloop) or adds C after it; the tile is
stored by TMA, which the next tile's mainloop overlaps. Variants: tile shapes, Triton's warp
specialisation of the tile loop (where the installed Triton has it on Hopper), a split
epilogue. Against cuBLAS: ``addmm_`` (what ``accumulate_grad_weight`` runs), ``mm`` into C (the
first chunk's overwrite), and one GEMM over all the tokens (the floor's). Every Triton result
is checked against an fp32 product first (a variant that fails is reported, not timed).

    python benchmarks/experiments/grad_w_triton_ab.py \\
        --out benchmarks/experiments/results/grad_w_triton_ab.json
    TRITON_INTERPRET=1 python benchmarks/experiments/grad_w_triton_ab.py --check   # CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# (N, H, V, rows a chunk at the default budget): grad_w_gemm_ab.py's heads, then the
# distillation student head of issue 30 (8192 tokens, H 2048, V 128256, 768-row chunks).
HEADS = (
    (4096, 2560, 262144, 768),
    (4096, 2880, 201088, 1024),
    (8192, 3584, 152064, 1536),
    (4096, 1152, 262144, 768),
    (8192, 2048, 128256, 768),
    (8192, 4096, 128256, 1024),
)

# (BM over V, BN over H, BK over rows, stages, warps)
TILES = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4))
INTERPRET_TILES = ((16, 32, 16, 1, 1),)


@triton.jit
def _grad_w_kernel(
    g_desc, x_desc, c_desc, R, V, H,
    ACCUMULATE: tl.constexpr, C_FIRST: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):  # fmt: skip
    tiles_m = tl.cdiv(V, BM)
    tiles_n = tl.cdiv(H, BN)
    for tile in tl.range(
        tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=not WARP_SPECIALIZE,
        warp_specialize=WARP_SPECIALIZE,
    ):  # fmt: skip
        # H-tiles of one V-block run back to back: G's column block (rows x BM) is read from
        # HBM once and from L2 by the other tiles_n - 1 (X, rows x H, stays in L2 throughout).
        off_m = (tile // tiles_n) * BM
        off_n = (tile % tiles_n) * BN
        if ACCUMULATE and C_FIRST:
            acc = c_desc.load([off_m, off_n]).to(tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, R, BK):  # TMA fills rows past R with zeros
            acc = tl.dot(g_desc.load([k, off_m]).T, x_desc.load([k, off_n]), acc)
        if SPLIT:  # two half-width epilogues: less shared memory for the store
            acc = tl.reshape(acc, (BM, 2, BN // 2))
            acc = tl.permute(acc, (0, 2, 1))
            left, right = tl.split(acc)
            if ACCUMULATE and not C_FIRST:
                left += c_desc.load([off_m, off_n]).to(tl.float32)
                right += c_desc.load([off_m, off_n + BN // 2]).to(tl.float32)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BN // 2], right.to(c_desc.dtype))
        else:
            if ACCUMULATE and not C_FIRST:
                acc += c_desc.load([off_m, off_n]).to(tl.float32)
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def _programs(device: torch.device, tiles: int, interpret: bool) -> int:
    if interpret:
        return min(3, tiles)
    return min(torch.cuda.get_device_properties(device).multi_processor_count, tiles)


def grad_w(c, g, x, tiles, accumulate=True, c_first=False, split=False, ws=False) -> None:
    """``c (+)= g^T x`` in place (c: V x H, g: rows x V, x: rows x H; contiguous half tensors)."""
    bm, bn, bk, stages, warps = tiles
    rows, vocab = g.shape
    hidden = x.shape[1]
    n_tiles = triton.cdiv(vocab, bm) * triton.cdiv(hidden, bn)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    programs = _programs(c.device, n_tiles, interpret)
    # The kernel's own descriptors: C's block is half-width when the epilogue is split.
    c_block = [bm, bn // 2] if split else [bm, bn]
    _grad_w_kernel[(programs,)](
        TensorDescriptor.from_tensor(g, [bk, bm]),
        TensorDescriptor.from_tensor(x, [bk, bn]),
        TensorDescriptor.from_tensor(c, c_block),
        rows, vocab, hidden,
        ACCUMULATE=accumulate, C_FIRST=c_first, SPLIT=split, BM=bm, BN=bn, BK=bk,
        PROGRAMS=programs, WARP_SPECIALIZE=ws, num_stages=stages, num_warps=warps,
    )  # fmt: skip


def _alloc(size: int, alignment: int, stream) -> torch.Tensor:  # Triton's scratch for on-device TMA
    return torch.empty(size, dtype=torch.int8, device="cuda")


def variants(interpret: bool):
    """(name, kwargs) of every Triton variant to check and time."""
    tiles_list = INTERPRET_TILES if interpret else TILES
    ws_list = (False,) if interpret else (False, True)
    for tiles, c_first, split, ws in itertools.product(tiles_list, (False, True), (False, True), ws_list):
        if split and c_first:
            continue
        name = "x".join(map(str, tiles)) + ("_cfirst" if c_first else "") + ("_split" if split else "")
        yield name + ("_ws" if ws else ""), dict(tiles=tiles, c_first=c_first, split=split, ws=ws)


def check(c0, g, x, kwargs) -> float:
    """Largest error of the kernel's accumulate against an fp32 product, over the sum's size."""
    want = c0.float() + g.float().t() @ x.float()
    c = c0.clone()
    grad_w(c, g, x, **kwargs)
    return ((c.float() - want).abs().max() / want.abs().max()).item()


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200)


def head_row(n: int, h: int, v: int, rows: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    c = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-2
    g = torch.randn(rows, v, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    row = {"N": n, "H": h, "V": v, "rows": rows, "chunks": -(-n // rows)}
    row["addmm_ms"] = timed(lambda: c.addmm_(g.t(), x))
    row["mm_ms"] = timed(lambda: torch.mm(g.t(), x, out=c))
    c0 = torch.randn(v, h, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-2
    triton_rows = {}
    for name, kwargs in variants(False):
        try:
            err = check(c0, g, x, kwargs)
            entry = {"rel_err": err}
            if err < 1e-2:
                entry["accumulate_ms"] = timed(lambda kw=kwargs: grad_w(c, g, x, **kw))
                entry["overwrite_ms"] = timed(lambda kw=kwargs: grad_w(c, g, x, accumulate=False, **kw))
        except Exception as exc:  # a variant this Triton cannot build on this GPU
            entry = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        triton_rows[name] = entry
        print(name, json.dumps(entry), flush=True)
    row["triton"] = triton_rows
    g.resize_(0)  # room for the whole-call operands
    best = min((e["accumulate_ms"], k) for k, e in triton_rows.items() if "accumulate_ms" in e)
    row["best_triton"] = {"name": best[1], "accumulate_ms": best[0]}
    g_all = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=gen) * 1e-3
    x_all = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    row["one_gemm_ms"] = timed(lambda: torch.mm(g_all.t(), x_all, out=c))
    chunks = n / rows
    row["call_cublas_ms"] = row["mm_ms"] + row["addmm_ms"] * (chunks - 1)
    best_over = triton_rows[best[1]]["overwrite_ms"]
    row["call_triton_ms"] = best_over + best[0] * (chunks - 1)
    return row


def run_check() -> int:
    """Under the interpreter: every variant against an fp32 product at sizes off the tiles."""
    worst = 0.0
    for rows, v, h in ((40, 68, 52), (16, 32, 32), (33, 100, 36)):  # 16-byte rows (TMA)
        g = torch.randn(rows, v).to(torch.bfloat16).float()
        x = torch.randn(rows, h).to(torch.bfloat16).float()
        c0 = torch.randn(v, h).to(torch.bfloat16).float()
        for name, kwargs in variants(True):
            err = check(c0, g, x, kwargs)
            worst = max(worst, err)
            print(rows, v, h, name, f"{err:.2e}")
    print("worst", worst)
    return 0 if worst < 1e-5 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--check", action="store_true", help="interpreter check only (CPU)")
    parser.add_argument("--heads", type=int, nargs="*", help="indices into HEADS")
    args = parser.parse_args()
    if args.check:
        return run_check()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    triton.set_allocator(_alloc)
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "rows": []}
    for i in args.heads if args.heads is not None else range(len(HEADS)):
        try:
            out["rows"].append(head_row(*HEADS[i]))
        except Exception:
            traceback.print_exc()
        print(json.dumps({k: v for k, v in out["rows"][-1].items() if k != "triton"}), flush=True)
        torch.cuda.empty_cache()
        if args.out:
            args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
