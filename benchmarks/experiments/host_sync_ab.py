"""What the forward's host sync costs, and what the row kernels' launch shape buys (issues 29, 30).

With no ignored label the label check's host sync is the only thing between the op and a
launch queue that stays ahead of the GPU: after it the GPU waits while the host sets up the
chunk loop (``op_gaps.json``: 475 us before the first logits GEMM at 8192x2048x128256). Three
parts, one run, one GPU, every label kept:

1. ``ce``: the fused cross-entropy at grid points, fwd+bwd, rotated over ``--rounds``:
   ``ours``; ``ours_no_sync``, the same op with the label check replaced by one that trusts the
   labels and reads nothing back (what an op without the sync could reach at best; valid here
   only because every label is in range and kept, which the script checks by comparing losses);
   ``ours_cublas_logits`` (``Tuning(fused_logits=False)``) and the same without the sync; and
   torch.compile of the eager loss.
2. ``distill``: the fused distillation at the issue's setting (independent heads, beta 0.5,
   nothing ignored): ``ours`` and ``ours_no_sync`` (``validation.check_values`` trusted the same
   way), against the four-GEMM floor.
3. ``distill_rows``: the distillation row kernel alone on one 1024-row chunk of bf16 logits
   (V=128256, beta 0.5, with partials, gradient in place) for each (block, warps) launch shape,
   and the cross-entropy row kernel on the same chunk for comparison; GB/s counts the bytes the
   passes move at one read per pass.

    python benchmarks/experiments/host_sync_ab.py --out benchmarks/experiments/results/host_sync_ab.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distill  # noqa: E402
import flce  # noqa: E402
from common import bench, environment, fwd_bwd, make_inputs, time_floor, write_json  # noqa: E402

CE_POINTS = (  # (N, H, V) from docs/results/grid_no_ignored.md, small and large
    (2048, 2048, 128256),
    (4096, 2048, 49152),
    (4096, 4096, 32000),
    (4096, 3072, 128256),
    (8192, 2048, 128256),
    (2048, 896, 151936),
    (8192, 896, 151936),
    (4096, 1536, 151936),
    (4096, 2560, 262144),
    (8192, 3584, 152064),
)


@contextlib.contextmanager
def no_label_sync():
    """The label checks of both ops replaced by ones that read nothing back (every label kept)."""
    from liger_patch.ops.core.kept_rows import CheckedLabels
    from liger_patch.ops.cross_entropy import operator
    from liger_patch.ops.distillation import operator as distillation_operator

    def trusted(labels, vocab, opts, divisor, num_items, started=None):
        return CheckedLabels(labels, None, None, labels.shape[0])

    def trusted_count(labels, vocab, ignore_index, divisor=None):
        return labels.shape[0]

    with (
        mock.patch.object(operator, "checked_labels", trusted),
        mock.patch.object(distillation_operator.validation, "check_values", trusted_count),
    ):
        yield


def _unsynced(fn):
    def run(*args, **kwargs):
        with no_label_sync():
            return fn(*args, **kwargs)

    return run


CE_IMPLS = {
    "ours": flce.ours,
    "ours_no_sync": _unsynced(flce.ours),
    "ours_cublas_logits": flce.ours_cublas_logits,
    "ours_cublas_logits_no_sync": _unsynced(flce.ours_cublas_logits),
    "torch_compile": flce.torch_compile,
}


def rotated_medians(fns: dict, args: tuple, floor, rounds: int, rep_ms: int) -> dict:
    floors, times = [], {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        floors.append(floor())
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(bench(lambda fn=fns[name]: fwd_bwd(fn, *args), rep_ms))
    f = statistics.median(floors)
    out = {"floor_ms": f}
    for name, ms in times.items():
        out[name] = {"ms": statistics.median(ms), "x_floor": statistics.median(ms) / f, "ms_rounds": ms}
    return out


def ce_part(rounds: int, rep_ms: int) -> list[dict]:
    rows = []
    for n, h, v in CE_POINTS:
        hidden, weight, labels = make_inputs(n, h, v, logit_std=3.0)
        flce.reset_compiled()
        losses = {name: float(fwd_bwd(fn, hidden, weight, labels)) for name, fn in CE_IMPLS.items()}
        row = {"N": n, "H": h, "V": v, "losses": losses}
        row.update(
            rotated_medians(
                CE_IMPLS,
                (hidden, weight, labels),
                lambda hidden=hidden, weight=weight: time_floor(hidden.detach(), weight.detach(), rep_ms),
                rounds,
                rep_ms,
            )
        )
        print({k: (v["x_floor"] if isinstance(v, dict) and "x_floor" in v else v) for k, v in row.items()})
        rows.append(row)
        del hidden, weight, labels
        torch.cuda.empty_cache()
    return rows


def distill_part(rounds: int, rep_ms: int) -> list[dict]:
    rows = []
    for point in (p for p in distill.POINTS if p.n == 8192):
        s_h, s_w, labels, t_h, t_w = distill.make_distill_inputs(point, torch.bfloat16, 0.0, 0.0, "cuda")
        setting = distill.Setting(teacher=(t_h, t_w))
        fns = {
            "ours": distill.bound("ours", setting),
            "ours_no_sync": _unsynced(distill.bound("ours", setting)),
        }
        losses = {name: float(fwd_bwd(fn, s_h, s_w, labels)) for name, fn in fns.items()}
        row = {"pair": point.pair, "N": point.n, "H_s": point.h_s, "H_t": point.h_t, "V": point.v}
        row["losses"] = losses
        row.update(
            rotated_medians(
                fns,
                (s_h, s_w, labels),
                functools.partial(distill.time_floor, s_h.detach(), s_w.detach(), t_h, t_w, rep_ms),
                rounds,
                rep_ms,
            )
        )
        print(row)
        rows.append(row)
        del s_h, s_w, labels, t_h, t_w, setting, fns
        torch.cuda.empty_cache()
    return rows


def rows_part(rep_ms: int) -> dict:
    from liger_patch.ops.core.triton.logits import logits_with_partials
    from liger_patch.ops.distillation.options import build_distill_options
    from liger_patch.ops.distillation.triton import rows as kernel

    rows, h, v = 1024, 2048, 128256
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_s = (torch.randn(v, h, device="cuda", generator=gen) * (3 / h**0.5)).bfloat16()
    w_t = (torch.randn(v, h, device="cuda", generator=gen) * (3 / h**0.5)).bfloat16()
    labels = torch.randint(0, v, (rows,), device="cuda", generator=gen)
    coef = torch.full((rows,), 1.0 / rows, device="cuda")
    s_logits = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
    t_logits = torch.empty_like(s_logits)
    base = build_distill_options(beta=0.5)
    partials = (
        logits_with_partials(x, w_s, None, base.student, s_logits)[:2],
        logits_with_partials(x, w_t, None, base.teacher, t_logits)[:2],
    )
    s_copy = s_logits.clone()
    copy_ms = bench(lambda: s_logits.copy_(s_copy), rep_ms)
    out = {"rows": rows, "V": v, "copy_ms": copy_ms, "shapes": []}
    reference = None
    shapes = ((1024, 4), (2048, 8), (2048, 16), (4096, 8), (4096, 16), (4096, 32), (8192, 16), (8192, 32))
    opts = build_distill_options(beta=0.5)
    for block, warps in shapes:

        def run(block=block, warps=warps):
            s_logits.copy_(s_copy)
            with mock.patch.object(kernel, "launch_config", lambda *_: (block, warps)):
                return kernel.distill_rows_triton(
                    s_logits, t_logits, labels, opts, grad=s_logits, coef=coef, partials=partials
                )

        loss = run()
        if reference is None:
            reference = (loss.clone(), s_logits.clone())
        loss_diff = float((loss - reference[0]).abs().max() / reference[0].abs().max())
        g, g_ref = s_logits.float(), reference[1].float()
        grad_diff = float((g - g_ref).abs().max() / g_ref.abs().max())
        ms = bench(run, rep_ms) - copy_ms
        moved = rows * v * 2 * 5  # mixture pass reads both sides (4 B); the last reads both, writes one (6 B)
        record = {"block": block, "warps": warps, "ms": ms, "gb_s": moved / ms / 1e6}
        record.update(loss_rel_diff=loss_diff, grad_rel_diff=grad_diff)
        out["shapes"].append(record)
        print(out["shapes"][-1])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rep-ms", type=int, default=150)
    p.add_argument("--parts", default="ce,distill,distill_rows")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {"environment": environment(), "rounds": args.rounds, "rep_ms": args.rep_ms}
    parts = args.parts.split(",")
    if "distill_rows" in parts:
        result["distill_rows"] = rows_part(args.rep_ms)
        write_json(args.out, result)
    if "distill" in parts:
        result["distill"] = distill_part(args.rounds, args.rep_ms)
        write_json(args.out, result)
    if "ce" in parts:
        result["ce"] = ce_part(args.rounds, args.rep_ms)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
