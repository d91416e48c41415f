"""Plot benchmarks/host_bound.py's step rows: patched / unpatched step time against the tokens of
the micro-batch, one line per model and share of ignored labels (issue 43's target 3: at or
under 1).

    python benchmarks/plot_host_bound.py docs/results/host_bound.json docs/results/host_bound_steps.png
"""

from __future__ import annotations

import json
import sys


def step_lines(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``"model, x% ignored"`` -> (tokens, patched / unpatched) points, by tokens: the row's
    ``paired_ratio`` where it has one (rounds paired in time), else the ratio of its medians."""
    lines: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("part") == "step" and r.get("patched_step_ms") and r.get("unpatched_step_ms"):
            key = f"{r['model']}, {r['ignored']:.0%} ignored"
            ratio = r.get("paired_ratio") or r["patched_step_ms"] / r["unpatched_step_ms"]
            lines.setdefault(key, []).append((r["tokens"], ratio))
    return {key: sorted(points) for key, points in lines.items()}


def main(argv: list[str]) -> int:
    import matplotlib  # imported here: step_lines is tested where matplotlib is not installed

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src, out = argv
    with open(src) as f:
        data = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, points in step_lines(data["rows"]).items():
        ax.plot(*zip(*points, strict=True), marker="o", label=key)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per micro-batch")
    ax.set_ylabel("patched / unpatched step time")
    ax.set_title(f"Training steps on {data['device']} (paired rounds, fused AdamW)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
