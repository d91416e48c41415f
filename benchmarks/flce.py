"""Fused linear cross-entropy, fwd+bwd, side by side on one GPU, as ratios to the three-GEMM floor.

The floor is what any exact method must do: logits = h W^T, grad_h = G W and grad_W = G^T h,
timed through cuBLAS in the same run. Every implementation is timed with
``triton.testing.do_bench`` (median) on the same random bf16 inputs, and its extra peak memory
(beyond the inputs and their gradients) is read from the CUDA allocator.

    python benchmarks/flce.py                        # the issue-2 shape, ours vs torch eager
    python benchmarks/flce.py --impls all --shapes all --out docs/results/flce.json
    python benchmarks/flce.py --shapes all --impls ours --rep-ms 400   # quick A/B of ours
    python benchmarks/flce.py --grid --rep-ms 300 --out docs/results/grid.json   # the shape grid
    python benchmarks/flce.py --grid --points 0:17 ...   # a slice of it (rows in grid order)

``--grid`` runs the points of ``benchmarks/grid.py`` (bf16, softcap and AMP points; logits with a
standard deviation of 3), each with 20 % of the labels ignored and with none, with the
implementations of ``GRID_IMPLS``; ``torch_linear_ce`` is PyTorch's own chunked op (torch >= 2.13;
on an older torch, and at softcap points, its cell says why it did not run). Shapes, inputs,
timing and the memory measure come from ``benchmarks/common.py``.
Peers (liger-kernel, cut-cross-entropy) are used when importable.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

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
    report_row,
    time_floor,
)
from grid import GRID, GRID_IGNORE_FRACS, GRID_INPUTS, GridPoint


def _softcapped(logits, softcap):
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def torch_eager(hidden, weight, labels, softcap=None):
    return F.cross_entropy(_softcapped((hidden @ weight.t()).float(), softcap), labels, ignore_index=-100)


def ours(hidden, weight, labels, softcap=None, **options):
    from liger_patch import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap, **options)


def ours_cublas_logits(hidden, weight, labels, softcap=None):
    """Ours with the logits GEMM left to cuBLAS and the row kernel's two passes (the default
    before docs/perf-notes.md item 19), for the side-by-side comparison."""
    from liger_patch.ops.core.tuning import Tuning

    return ours(hidden, weight, labels, softcap, tuning=Tuning(fused_logits=False))


def ours_balanced(hidden, weight, labels, softcap=None):
    """Ours with token chunks of one size (``Tuning(balanced_chunks=True)``)."""
    from liger_patch.ops.core.tuning import Tuning

    return ours(hidden, weight, labels, softcap, tuning=Tuning(balanced_chunks=True))


def ours_fp32_grad_weight(hidden, weight, labels, softcap=None):
    """Ours with grad_W summed in fp32 (``Tuning(fp32_grad_weight=True)``; the default where an
    fp32 copy fitted in the budget before docs/perf-notes.md item 25)."""
    from liger_patch.ops.core.tuning import Tuning

    return ours(hidden, weight, labels, softcap, tuning=Tuning(fp32_grad_weight=True))


def ours_all_rows(hidden, weight, labels, softcap=None):
    """Ours computing every row, the ignored ones too (``Tuning(skip_ignored_share=1.0)``; the
    default before item 28 skipped ignored rows)."""
    from liger_patch.ops.core.tuning import Tuning

    return ours(hidden, weight, labels, softcap, tuning=Tuning(skip_ignored_share=1.0))


def ours_fp32_logits(hidden, weight, labels, softcap=None):
    """Ours with logits chunks stored in fp32 (``logits_dtype=torch.float32``)."""
    return ours(hidden, weight, labels, softcap, logits_dtype=torch.float32)


def ours_lean(hidden, weight, labels, softcap=None):
    """Ours at the lean memory budget (32 MiB): the two-pass path."""
    return ours(hidden, weight, labels, softcap, memory_budget="lean")


_compiled = None


def torch_compile(hidden, weight, labels, softcap=None):
    """``torch.compile`` of the eager loss, compiled for each shape (``reset_compiled`` between
    shapes), as a training run of one shape gets it."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(torch_eager, dynamic=False)
    return _compiled(hidden, weight, labels, softcap)


def reset_compiled() -> None:
    global _compiled
    _compiled = None
    torch._dynamo.reset()


def _torch_linear_ce_source():
    """PyTorch's chunked ``linear_cross_entropy`` op and its options class, from the installed
    torch (>= 2.13), else from the two source files of a torch >= 2.13 in the folder that
    ``TORCH_LCE_SOURCE`` names (``linear_cross_entropy.py``, ``linear_cross_entropy_options.py``
    from ``torch/nn/modules/``): pure Python on public torch APIs, so an older GPU image can run
    PyTorch's own code. ``None`` when neither is there."""
    if hasattr(F, "linear_cross_entropy"):
        from torch.nn.modules.linear_cross_entropy import _linear_cross_entropy_batch_chunked

        return _linear_cross_entropy_batch_chunked, torch.nn.LinearCrossEntropyOptions
    folder = os.environ.get("TORCH_LCE_SOURCE")
    if not folder:
        return None
    modules = []
    for name in ("linear_cross_entropy_options", "linear_cross_entropy"):
        spec = importlib.util.spec_from_file_location(f"torch_lce_{name}", Path(folder) / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
        modules.append(module)
    return modules[1]._linear_cross_entropy_batch_chunked, modules[0].LinearCrossEntropyOptions


def torch_linear_ce(hidden, weight, labels, softcap=None):
    """PyTorch's own ``F.linear_cross_entropy`` with its chunked path at its default options
    (``options=nn.LinearCrossEntropyOptions()``, torch >= 2.13), the op users will compare first:
    the op that ``F.linear_cross_entropy`` calls for ``reduction="mean"``, with the arguments it
    passes (``_torch_linear_ce_source`` says where the code comes from)."""
    source = _torch_linear_ce_source()
    if source is None:
        raise NotImplementedError(
            f"torch {torch.__version__} has no F.linear_cross_entropy (2.13+) and TORCH_LCE_SOURCE is unset"
        )
    if softcap is not None:
        raise NotImplementedError("F.linear_cross_entropy has no softcap")
    op, options_class = source
    n, h = hidden.shape
    options = options_class()._adjust(
        num_batches=n, in_features=h, num_classes=weight.shape[0], dtype=hidden.dtype, device=hidden.device
    )
    grads = torch.is_grad_enabled()
    return op(
        hidden,
        weight,
        labels,
        None,  # linear_bias
        None,  # class weights
        "mean",
        -100,
        0.0,  # label smoothing
        options.batch_chunk_size,
        options.acc_policy,
        options.acc_dtype,
        options.allow_retain_graph,
        hidden.requires_grad and grads,
        weight.requires_grad and grads,
        False,
    )[0]


def liger_kernel(hidden, weight, labels, softcap=None):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, labels, ignore_index=-100, softcap=softcap)


def cut_cross_entropy(hidden, weight, labels, softcap=None):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, labels, ignore_index=-100, softcap=softcap)


IMPLS: dict[str, Callable] = {
    "ours": ours,
    "ours_balanced": ours_balanced,
    "ours_all_rows": ours_all_rows,
    "ours_fp32_grad_weight": ours_fp32_grad_weight,
    "ours_cublas_logits": ours_cublas_logits,
    "ours_fp32_logits": ours_fp32_logits,
    "ours_lean": ours_lean,
    "torch_eager": torch_eager,
    "torch_compile": torch_compile,
    "torch_linear_ce": torch_linear_ce,
    "liger_kernel": liger_kernel,
    "cut_cross_entropy": cut_cross_entropy,
}
GRID_IMPLS = (
    "ours",
    "ours_balanced",
    "ours_lean",
    "torch_compile",
    "torch_linear_ce",
    "liger_kernel",
    "cut_cross_entropy",
)


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


def with_autocast(fn: Callable) -> Callable:
    """``fn`` under ``torch.autocast("cuda", bf16)``: fp32 weight and hidden, bf16 GEMMs (AMP)."""

    def run(hidden, weight, labels, softcap=None):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fn(hidden, weight, labels, softcap)

    return run


def bench_point(
    point: GridPoint,
    impl_names: list[str],
    ignore_frac: float,
    rep_ms: int,
    logit_std: float = 1.0,
    rounds: int = 1,
) -> dict:
    """One shape: the floor and each implementation's median ms, ratio and extra MiB. With
    ``rounds`` > 1 the floor and every implementation are timed once per round, each round
    starting with another implementation (the first one timed after a new shape ran slower by up
    to 6 % in the first grid run); the medians over the rounds are reported."""
    n, h, v = point.n, point.h, point.v
    dtype = torch.float32 if point.amp else torch.bfloat16
    hidden, weight, labels = make_inputs(n, h, v, dtype, ignore_frac, logit_std=logit_std)
    row: dict = {
        "shape": point.name,
        "model": point.model,
        "N": n,
        "H": h,
        "V": v,
        "softcap": point.softcap,
        "amp": point.amp,
        "dtype": "float32 weights under bf16 autocast" if point.amp else "bfloat16",
        "ignore_frac": ignore_frac,
        "logit_std": logit_std,
    }
    # the floor is three bf16 GEMMs (under AMP too: autocast runs the head's GEMMs in bf16)
    floors, times, row["impls"] = [], {}, {}
    reset_compiled()
    for round_ in range(rounds):
        floors.append(time_floor(hidden.detach().bfloat16(), weight.detach().bfloat16(), rep_ms))
        shift = round_ % max(1, len(impl_names))  # each round starts with another implementation
        for impl in impl_names[shift:] + impl_names[:shift]:
            if "error" in row["impls"].get(impl, {}):
                continue
            fn = functools.partial(
                with_autocast(IMPLS[impl]) if point.amp else IMPLS[impl], softcap=point.softcap
            )
            try:
                fwd_bwd(fn, hidden, weight, labels)  # warm-up / compile
                times.setdefault(impl, []).append(
                    bench(lambda fn=fn: fwd_bwd(fn, hidden, weight, labels), rep_ms)
                )
                if round_ == 0:
                    row["impls"][impl] = {"extra_mib": extra_memory_mib(fn, hidden, weight, labels)}
            # a peer that refuses an input (CCE's backward under AMP) is one cell, not the run
            except Exception as exc:
                row["impls"][impl] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            hidden.grad = weight.grad = None
            torch.cuda.empty_cache()
    row["floor_ms"] = statistics.median(floors)
    row["floor_tflops"] = 3 * 2 * n * h * v / row["floor_ms"] / 1e9
    for impl, ms in times.items():
        if "error" not in row["impls"][impl]:
            ratios = [t / f for t, f in zip(ms, floors, strict=True)]
            row["impls"][impl].update(
                ms=statistics.median(ms), x_floor=statistics.median(ratios), ms_rounds=ms
            )
    row["impls"] = {impl: row["impls"][impl] for impl in impl_names if impl in row["impls"]}
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
        shape = f"{r['N']}, {r['H']}, {r['V']}"
        shape += ", softcap" if r.get("softcap") else ""
        shape += ", AMP" if r.get("amp") else ""
        shape += f", {r.get('ignore_frac', 0):.0%} ignored"
        lines.append(f"| {shape} | {r['floor_ms']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def select_points(args) -> tuple[list[GridPoint], float, tuple[float, ...]]:
    """The points to run, with their input spread and the shares of ignored labels to run each at
    (``--ignore-frac``, a comma list; the grid's default: ``GRID_IGNORE_FRACS``)."""
    fracs = None if args.ignore_frac is None else tuple(float(f) for f in args.ignore_frac.split(","))
    if args.grid:
        points = list(GRID)
        if args.points and ":" in args.points:
            lo, _, hi = args.points.partition(":")
            points = points[int(lo or 0) : int(hi) if hi else None]
        elif args.points:
            points = [points[int(i)] for i in args.points.split(",")]
        return points, GRID_INPUTS["logit_std"], fracs or GRID_IGNORE_FRACS
    names = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    return [GridPoint("headline", *SHAPES[name]) for name in names], 1.0, fracs or (0.0,)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="8192x4096x128256", help="comma list of " + ", ".join(SHAPES))
    parser.add_argument("--grid", action="store_true", help="the points of benchmarks/grid.py instead")
    parser.add_argument("--points", default=None, help="with --grid: a slice START:STOP or indices I,J,...")
    parser.add_argument(
        "--impls",
        default=None,
        help="comma list or 'all' (default: ours,torch_eager; grid: " + ",".join(GRID_IMPLS) + ")",
    )
    parser.add_argument(
        "--ignore-frac",
        default=None,
        help="shares of labels set to -100, a comma list (default 0; grid: "
        + ",".join(map(str, GRID_IGNORE_FRACS))
        + ", every point at each)",
    )
    parser.add_argument("--rep-ms", type=int, default=2000, help="do_bench repetition time per impl")
    parser.add_argument(
        "--rounds", type=int, default=1, help="time every impl this many times, rotating the order"
    )
    parser.add_argument("--out", default=None, help="write JSON here (a .md table is written beside it)")
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/flce.py"):
        return 2
    points, logit_std, ignore_fracs = select_points(args)
    default_impls = ",".join(GRID_IMPLS) if args.grid else "ours,torch_eager"
    impls = list(IMPLS) if args.impls == "all" else (args.impls or default_impls).split(",")

    result = {
        **environment(),
        "method": "fwd+bwd, triton.testing.do_bench median; floor = 3 cuBLAS bf16 GEMMs; "
        "extra = peak allocated minus inputs and their grads",
        "fp64_check": {impl: _fp64_check(impl) for impl in impls},
        "rows": [],
    }
    # results are written after every point, so a cut-off run keeps them
    for point, ignore_frac in itertools.product(points, ignore_fracs):
        result["rows"].append(bench_point(point, impls, ignore_frac, args.rep_ms, logit_std, args.rounds))
        report_row(result, markdown(result["rows"]), args.out)
    return 0


def _fp64_check(impl: str) -> float | str:
    try:
        return check_against_fp64(IMPLS[impl], 1024, 512, 8191)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


if __name__ == "__main__":
    sys.exit(main())
