"""Fused linear cross-entropy, fwd+bwd, side by side on one GPU, as ratios to the three-GEMM floor.

The floor is what any exact method must do: logits = h W^T, grad_h = G W and grad_W = G^T h,
timed through cuBLAS in the same run. Every implementation is timed with
``triton.testing.do_bench`` (median) on the same random bf16 inputs, and its extra peak memory
(beyond the inputs and their gradients) is read from the CUDA allocator.

    python benchmarks/flce.py                        # the issue-2 shape, ours vs torch eager
    python benchmarks/flce.py --impls all --shapes all --out docs/results/flce.json
    python benchmarks/flce.py --shapes all --impls ours --rep-ms 400   # quick A/B of ours

Shapes, inputs, timing and the memory measure come from ``benchmarks/common.py``. Peers
(liger-kernel, cut-cross-entropy) are used when importable.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import (
    SHAPES,
    bench,
    environment,
    extra_memory_mib,
    fwd_bwd,
    make_inputs,
    need_cuda,
    time_floor,
    write_json,
)


def torch_eager(hidden, weight, labels):
    return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100)


def ours(hidden, weight, labels):
    from liger_patch import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, weight, labels)


def ours_cublas_logits(hidden, weight, labels):
    """Ours with the logits GEMM left to cuBLAS and the row kernel's two passes (the default
    before docs/perf-notes.md item 19), for the side-by-side comparison."""
    from liger_patch import fused_linear_cross_entropy
    from liger_patch.ops.tuning import Tuning

    return fused_linear_cross_entropy(hidden, weight, labels, tuning=Tuning(fused_logits=False))


def ours_fp32_logits(hidden, weight, labels):
    """Ours with logits chunks stored in fp32 (``logits_dtype=torch.float32``)."""
    from liger_patch import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, weight, labels, logits_dtype=torch.float32)


def ours_lean(hidden, weight, labels):
    """Ours at the lean memory budget (32 MiB): the two-pass path."""
    from liger_patch import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, weight, labels, memory_budget="lean")


_compiled = None


def torch_compile(hidden, weight, labels):
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(torch_eager)
    return _compiled(hidden, weight, labels)


def liger_kernel(hidden, weight, labels):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=-100)


def cut_cross_entropy(hidden, weight, labels):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, labels, ignore_index=-100)


IMPLS: dict[str, Callable] = {
    "ours": ours,
    "ours_cublas_logits": ours_cublas_logits,
    "ours_fp32_logits": ours_fp32_logits,
    "ours_lean": ours_lean,
    "torch_eager": torch_eager,
    "torch_compile": torch_compile,
    "liger_kernel": liger_kernel,
    "cut_cross_entropy": cut_cross_entropy,
}


def check_against_fp64(fn, n: int, h: int, v: int) -> float:
    """Relative error of loss and grads against fp64, on a slice small enough for an fp64 reference."""
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, 0.3, seed=1)
    fwd_bwd(fn, hidden, weight, labels)
    hr = hidden.detach().double().requires_grad_()
    wr = weight.detach().double().requires_grad_()
    ref = F.cross_entropy(hr @ wr.t(), labels, ignore_index=-100)
    ref.backward()
    loss = fn(hidden.detach(), weight.detach(), labels)
    errs = [
        float((loss.double() - ref).abs() / ref.abs()),
        float((hidden.grad.double() - hr.grad).norm() / hr.grad.norm()),
        float((weight.grad.double() - wr.grad).norm() / wr.grad.norm()),
    ]
    return max(errs)


def bench_shape(name: str, impl_names: list[str], ignore_frac: float, rep_ms: int) -> dict:
    n, h, v = SHAPES[name]
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, ignore_frac)
    row: dict = {"shape": name, "N": n, "H": h, "V": v, "dtype": "bfloat16", "ignore_frac": ignore_frac}

    floor_ms = time_floor(hidden.detach(), weight.detach(), rep_ms)
    flops = 3 * 2 * n * h * v
    row["floor_ms"] = floor_ms
    row["floor_tflops"] = flops / floor_ms / 1e9
    row["impls"] = {}
    for impl in impl_names:
        fn = IMPLS[impl]
        try:
            fwd_bwd(fn, hidden, weight, labels)  # warm-up / compile
            ms = bench(lambda fn=fn: fwd_bwd(fn, hidden, weight, labels), rep_ms)
            mem = extra_memory_mib(fn, hidden, weight, labels)
            err = check_against_fp64(fn, 1024, 512, 8191)
            row["impls"][impl] = {"ms": ms, "x_floor": ms / floor_ms, "extra_mib": mem, "max_rel_err": err}
        except (ImportError, torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            row["impls"][impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        hidden.grad = weight.grad = None
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict]) -> str:
    impls = list(dict.fromkeys(k for r in rows for k in r["impls"]))
    head = "| N, H, V | floor ms | " + " | ".join(impls) + " |"
    sep = "|---" * (len(impls) + 2) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for k in impls:
            c = r["impls"].get(k, {})
            if "ms" in c:
                cells.append(f"{c['ms']:.1f} ({c['x_floor']:.2f}x) {c['extra_mib']:.0f} MiB")
            else:
                cells.append(c.get("error", "-")[:40])
        lines.append(f"| {r['N']}, {r['H']}, {r['V']} | {r['floor_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="8192x4096x128256", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--impls", default="ours,torch_eager", help="comma list or 'all'")
    parser.add_argument("--ignore-frac", type=float, default=0.0, help="fraction of labels set to -100")
    parser.add_argument("--rep-ms", type=int, default=2000, help="do_bench repetition time per impl")
    parser.add_argument("--out", default=None, help="write JSON here (a .md table is written beside it)")
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/flce.py"):
        return 2
    shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    impls = list(IMPLS) if args.impls == "all" else args.impls.split(",")

    result = {
        **environment(),
        "method": "fwd+bwd, triton.testing.do_bench median; floor = 3 cuBLAS GEMMs; "
        "extra = peak allocated minus inputs and their grads",
        "rows": [],
    }
    for shape in shapes:  # results are written after every shape, so a cut-off run keeps them
        result["rows"].append(bench_shape(shape, impls, args.ignore_frac, args.rep_ms))
        table = markdown(result["rows"])
        print(table, flush=True)
        if args.out:
            write_json(args.out, result)
            with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
                f.write(
                    f"{result['device']}, torch {result['torch']}, triton {result['triton']}\n\n{table}\n"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
