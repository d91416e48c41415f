"""Plot benchmarks/flce.py results: time (as x floor) and extra memory against N, per implementation.

    python benchmarks/plot.py docs/results/flce.json docs/results/flce
writes docs/results/flce_time.png and docs/results/flce_memory.png.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> int:
    src, prefix = argv
    with open(src) as f:
        data = json.load(f)
    rows = sorted(data["rows"], key=lambda r: (r["N"], r["V"]))
    labels = [f"N={r['N']}\nH={r['H']}\nV={r['V']}" for r in rows]
    impls = list(dict.fromkeys(k for r in rows for k in r["impls"]))
    for metric, ylabel, name, log in (
        ("x_floor", "fwd+bwd time / three-GEMM floor", "time", False),
        ("extra_mib", "extra peak memory (MiB)", "memory", True),
    ):
        fig, ax = plt.subplots(figsize=(9, 4.8))
        for impl in impls:
            ys = [r["impls"].get(impl, {}).get(metric) for r in rows]
            xs = [i for i, y in enumerate(ys) if y is not None]
            ax.plot(xs, [ys[i] for i in xs], marker="o", label=impl)
        if metric == "x_floor":
            ax.axhline(1.0, color="black", lw=0.8)
            ax.axhline(1.10, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.set_title(f"{data['device']}, bf16, torch {data['torch']}, triton {data['triton']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(f"{prefix}_{name}.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
