"""The fused logits GEMM (``ops/core/triton/logits.py``) against cuBLAS at token-chunk shapes, for
several tile configurations ``(BM, BN, BK, stages, warps)`` (``Tuning.logits_tiles``).

Each chunk shape (rows, H, V) is timed with ``do_bench`` (median): cuBLAS ``mm`` into a bf16
chunk, and ``logits_with_partials`` per tile configuration (a configuration that does not fit
the GPU's shared memory, or fails to compile, gets its error).

    python benchmarks/experiments/logits_tiles_sweep.py \\
        --out benchmarks/experiments/results/logits_tiles_sweep.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import bench, environment, write_json  # noqa: E402

from liger_patch.ops.core.triton import logits  # noqa: E402
from liger_patch.ops.core.tuning import Tuning  # noqa: E402
from liger_patch.ops.cross_entropy.options import LossOptions  # noqa: E402

CHUNKS = (
    (2048, 2048, 128256),
    (2048, 4096, 128256),
    (768, 2560, 262144),
    (1536, 3584, 152064),
    (1280, 2880, 201088),
    (1536, 1536, 151936),
    (4096, 2560, 262144),
)
TILES = (
    (128, 256, 64, 3, 8),
    (256, 128, 64, 3, 8),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 4, 8),
    (128, 128, 64, 5, 8),
    (128, 256, 32, 5, 8),
    (128, 128, 128, 3, 8),
    (64, 256, 64, 4, 4),
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {**environment(), "rows": []}
    for rows, h, v in CHUNKS:
        x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) / h**0.5 * 3
        out = torch.empty(rows, v, device="cuda", dtype=torch.bfloat16)
        row = {
            "rows": rows,
            "H": h,
            "V": v,
            "cublas_ms": bench(lambda x=x, w=w, out=out: torch.mm(x, w.t(), out=out), args.rep_ms),
        }
        for tiles in TILES:
            opts = LossOptions(tuning=Tuning(logits_tiles=tiles))
            key = "x".join(map(str, tiles))
            try:
                if not logits.supported(x, w, torch.bfloat16, opts.tuning):
                    row[key] = "not supported here"
                    continue
                row[key] = bench(
                    lambda o=opts, x=x, w=w, out=out: logits.logits_with_partials(x, w, None, o, out),
                    args.rep_ms,
                )
            except Exception as exc:  # a configuration that does not compile is one cell
                row[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        print(row, flush=True)
        result["rows"].append(row)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
