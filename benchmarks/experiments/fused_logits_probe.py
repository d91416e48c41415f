"""Is the fused logits GEMM (``ops/core/triton/logits.py``) worth it? Its parts, side by side.

At one or more (N, H, V), in token chunks of the size the default budget gives, times:
cuBLAS's logits GEMM over all chunks; the fused Triton GEMM (logits plus log-sum-exp partials)
for each tile configuration in ``CONFIGS`` (passed as ``Tuning(logits_tiles=...)``); and the
row kernel with both passes, with its first pass only, and with the log-sum-exp given (what is
left when the partials replace pass 1). The fused path pays off when
``fused + pass2 < cublas + full``. The whole op, A/B, is
``benchmarks/experiments/chunk_sweep.py --fused-ab``.

    python benchmarks/experiments/fused_logits_probe.py \
        --out benchmarks/experiments/results/fused_logits_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import bench, need_cuda, write_json  # noqa: E402

from liger_patch.ops.core.budget import chunk_rows  # noqa: E402
from liger_patch.ops.core.triton import logits  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy.options import LossOptions  # noqa: E402
from liger_patch.ops.cross_entropy.triton.rows import ce_rows_triton  # noqa: E402

SHAPES = {"8192x4096x128256": (8192, 4096, 128256), "8192x2304x256000": (8192, 2304, 256000)}
# (BM, BN, BK, stages, warps); 128x256x64 with 4 stages needs more shared memory than Hopper has.
CONFIGS = [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4), (256, 128, 64, 3, 8)]


def probe_shape(name: str, rep: int) -> dict:
    n, hd, v = SHAPES[name]
    rows = chunk_rows(v, 512 << 20, 2, Tuning())
    gen = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hd, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(v, hd, device="cuda", generator=gen) / hd**0.5).bfloat16()
    labels = torch.randint(0, v, (rows,), device="cuda", generator=gen)
    buf = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
    chunks = [h[i : i + rows] for i in range(0, n, rows)]
    opts = LossOptions()
    coef = torch.full((rows,), 1.0 / n, device="cuda")
    coef_z = torch.zeros(rows, device="cuda")
    k = len(chunks)
    res: dict = {"shape": name, "rows_per_chunk": rows, "chunks": k}
    res["cublas_ms"] = bench(lambda: [torch.mm(c, w.t(), out=buf) for c in chunks], rep)
    torch.mm(chunks[0], w.t(), out=buf)
    _, lse = ce_rows_triton(buf, labels, opts)
    res["row_pass1_only_ms"] = k * bench(lambda: ce_rows_triton(buf, labels, opts), rep)
    full = dict(grad=buf, coef_ce=coef, coef_z=coef_z)
    res["row_both_passes_ms"] = k * bench(lambda: ce_rows_triton(buf, labels, opts, **full), rep)
    res["row_pass2_only_ms"] = k * bench(lambda: ce_rows_triton(buf, labels, opts, lse_in=lse, **full), rep)
    res["fused"] = []
    for config in CONFIGS:
        tiled = LossOptions(tuning=Tuning(logits_tiles=config))
        entry: dict = {"config": config}
        try:
            parts = logits.logits_with_partials(chunks[0], w, None, tiled, buf)
            entry["logits_max_abs_err"] = float((buf.float() - (chunks[0] @ w.t()).float()).abs().max())
            _, lse_fused = ce_rows_triton(buf, labels, tiled, partials=parts)
            entry["lse_max_abs_err"] = float((lse_fused - lse).abs().max())
            entry["ms"] = bench(
                lambda tiled=tiled: [logits.logits_with_partials(c, w, None, tiled, buf) for c in chunks], rep
            )
            entry["row_with_partials_ms"] = k * bench(
                lambda parts=parts, tiled=tiled: ce_rows_triton(buf, labels, tiled, partials=parts, **full),
                rep,
            )
            entry["fused_path_ms"] = entry["ms"] + entry["row_with_partials_ms"]
        except Exception as exc:  # noqa: BLE001 - a configuration that does not fit is a result
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(json.dumps(entry), flush=True)
        res["fused"].append(entry)
    res["cublas_path_ms"] = res["cublas_ms"] + res["row_both_passes_ms"]
    print(json.dumps({key: val for key, val in res.items() if key != "fused"}), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="all")
    parser.add_argument("--rep-ms", type=int, default=400)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not need_cuda("benchmarks/experiments/fused_logits_probe.py"):
        return 2
    shapes = list(SHAPES) if args.shapes == "all" else args.shapes.split(",")
    out = {"device": torch.cuda.get_device_name(), "rows": [probe_shape(s, args.rep_ms) for s in shapes]}
    if args.out:
        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
