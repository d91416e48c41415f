"""Plot a ``benchmarks/flce.py --grid`` result: one PNG per vocabulary size, the time of each
implementation as a multiple of the three-GEMM floor against N, a panel per (H, softcap, AMP).

    python benchmarks/plot_grid.py docs/results/grid.json docs/results/grid
writes docs/results/grid_V<vocab>.png. Several result files (slices of one grid) are merged:
    python benchmarks/plot_grid.py first_slice.json second_slice.json docs/results/grid
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

TOP = 1.8  # ratios above this are drawn at the top edge, with their value


def load_rows(paths: list[str]) -> tuple[dict, list[dict]]:
    """The first file's head (device, versions) and every file's rows."""
    head, rows = {}, []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        head = head or {k: v for k, v in data.items() if k != "rows"}
        rows += data["rows"]
    return head, rows


def panel_key(row: dict) -> tuple:
    return (row["H"], row.get("softcap") or 0.0, row.get("amp", False))


def panel_title(key: tuple) -> str:
    h, softcap, amp = key
    return f"H={h}" + (f", softcap {softcap:g}" if softcap else "") + (", AMP" if amp else ", bf16")


def plot_vocab(vocab: int, rows: list[dict], head: dict, path: str) -> None:
    panels = defaultdict(list)
    for row in rows:
        panels[panel_key(row)].append(row)
    keys = sorted(panels)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        panel = sorted(panels[key], key=lambda r: r["N"])
        impls = list(dict.fromkeys(k for r in panel for k in r["impls"]))
        for impl in impls:
            points = [
                (r["N"], r["impls"][impl]["x_floor"]) for r in panel if "x_floor" in r["impls"].get(impl, {})
            ]
            if not points:
                continue
            (line,) = ax.plot(
                *zip(*[(n, min(x, TOP)) for n, x in points], strict=True), marker="o", label=impl
            )
            for n, x in points:  # off the scale: a value at the top edge
                if x > TOP:
                    ax.annotate(
                        f"{x:.1f}x", (n, TOP), fontsize=6, color=line.get_color(), ha="center", va="top"
                    )
        ax.axhline(1.0, color="black", lw=0.8)
        ax.axhline(1.10, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_ylim(0.95, TOP + 0.1)
        ax.set_xlabel("N tokens")
        ax.set_title(f"{panel[0]['model']}: {panel_title(key)}", fontsize=9)
    axes[0][0].set_ylabel("fwd+bwd time / three-GEMM floor")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(
        f"V={vocab}; {head.get('device')}, torch {head.get('torch')}, triton {head.get('triton')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    *sources, prefix = argv
    head, rows = load_rows(sources)
    by_vocab = defaultdict(list)
    for row in rows:
        by_vocab[row["V"]].append(row)
    for vocab, vocab_rows in sorted(by_vocab.items()):
        plot_vocab(vocab, vocab_rows, head, f"{prefix}_V{vocab}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
