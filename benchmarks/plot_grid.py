"""Plot a ``benchmarks/flce.py --grid`` result: one PNG per vocabulary size, a column per (H,
softcap, AMP, share of ignored labels): on top each implementation's time as a multiple of the
three-GEMM floor against N (the axis reaches below the lowest value, ours included), below its
extra memory.

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
    return (row["H"], row.get("softcap") or 0.0, row.get("amp", False), row.get("ignore_frac", 0.2))


def panel_title(key: tuple) -> str:
    h, softcap, amp, ignored = key
    title = f"H={h}" + (f", softcap {softcap:g}" if softcap else "") + (", AMP" if amp else ", bf16")
    return f"{title}, {ignored:.0%} ignored"


def _series(panel: list[dict], impl: str, field: str) -> list[tuple[int, float]]:
    return [(r["N"], r["impls"][impl][field]) for r in panel if field in r["impls"].get(impl, {})]


def _plot_time(ax, panel: list[dict], impls: list[str], colors: dict) -> None:
    """× the floor against N; the axis starts below the lowest value (ours runs under 1×)."""
    values = [x for impl in impls for _, x in _series(panel, impl, "x_floor")]
    low = min([0.95, *values]) - 0.05
    for impl in impls:
        points = _series(panel, impl, "x_floor")
        if points:
            clipped = [(n, min(x, TOP)) for n, x in points]
            ax.plot(*zip(*clipped, strict=True), marker="o", label=impl, color=colors[impl])
        for n, x in points:  # off the scale: a value at the top edge
            if x > TOP:
                ax.annotate(f"{x:.1f}x", (n, TOP), fontsize=6, color=colors[impl], ha="center", va="top")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.10, color="grey", lw=0.8, ls="--")
    ax.set_ylim(low, TOP + 0.1)


def _plot_memory(ax, panel: list[dict], impls: list[str], colors: dict) -> None:
    """Extra memory (beyond inputs and gradients) against N, log scale."""
    for impl in impls:
        points = [(n, max(m, 1.0)) for n, m in _series(panel, impl, "extra_mib")]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=impl, color=colors[impl])
    ax.set_yscale("log")


def plot_vocab(vocab: int, rows: list[dict], head: dict, path: str) -> None:
    """One PNG: a column per panel (H, softcap, AMP, ignored share); time on top, memory below."""
    panels = defaultdict(list)
    for row in rows:
        panels[panel_key(row)].append(row)
    keys = sorted(panels)
    impls = list(dict.fromkeys(k for r in rows for k in r["impls"]))
    colors = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(2, len(keys), figsize=(4.2 * len(keys), 7.0), squeeze=False)
    for col, key in enumerate(keys):
        panel = sorted(panels[key], key=lambda r: r["N"])
        _plot_time(axes[0][col], panel, impls, colors)
        _plot_memory(axes[1][col], panel, impls, colors)
        axes[0][col].set_title(f"{panel[0]['model']}: {panel_title(key)}", fontsize=9)
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("N tokens")
    axes[0][0].set_ylabel("fwd+bwd time / three-GEMM floor")
    axes[1][0].set_ylabel("extra memory, MiB")
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
