"""One table of every 2-GPU training-step result: patched against unpatched step time and peak per rank.

Reads the JSON files the 2-GPU scripts wrote (``zero3_gpu.py``: ``zero3_h1024.json``,
``zero3.json``, ``zero2.json``, ``zero3_offload.json``, and ``zero3_sft.json`` for TRL's
``SFTTrainer``; ``distributed_gpu.py``: FSDP2; ``tp_gpu.py``: tensor parallelism;
``cp_gpu.py``: context parallelism) and writes the rows with the same fields, so that they can be
compared at a glance: ``docs/results/distributed_speed.json`` and ``.md``. A file that is missing
is skipped (its row says so).

    python benchmarks/distributed_table.py --results docs/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _deepspeed_rows(path: Path) -> list[dict]:
    found = json.loads(path.read_text())
    rows = []
    for row in found["rows"]:
        if "error" in row:
            rows.append({"setting": row["stage"], "row": row["row"], "error": row["error"]})
            continue
        trainer = "TRL SFTTrainer" if row.get("trainer") == "sft" else "HF Trainer"
        paired = row.get("patched_over_unpatched_paired")
        rows.append(
            {
                "setting": f"{trainer}, DeepSpeed {row['stage']}",
                "row": row["row"],
                "unpatched_step_ms": row["unpatched_step_ms"],
                "patched_step_ms": row["patched_step_ms"],
                "paired_ratio": None if paired is None else paired["median"],
                "unpatched_peak_gib_per_rank": row["unpatched_peak_gib_per_rank"],
                "patched_peak_gib_per_rank": row["patched_peak_gib_per_rank"],
                "parity_ok": row["parity_ok"],
                "device": found["device"],
                "source": path.name,
            }
        )
    return rows


def _paired_runs(path: Path, key: str, setting: str) -> list[dict]:
    """Rows of ``distributed_gpu.py`` / ``tp_gpu.py``: a run per (activation checkpointing, patched)."""
    found = json.loads(path.read_text())
    runs = found[key]
    rows = []
    for checkpointing in (False, True):
        pair = {r["patched"]: r for r in runs if r["activation_checkpointing"] == checkpointing}
        if len(pair) < 2:
            continue
        rows.append(
            {
                "setting": setting,
                "row": "llama_3_2_1b" + (", activation checkpointing" if checkpointing else ""),
                "unpatched_step_ms": 1e3 * pair[False]["median_step_s"],
                "patched_step_ms": 1e3 * pair[True]["median_step_s"],
                "paired_ratio": pair[True].get("paired_ratio"),  # alternating rounds (common.py)
                "unpatched_peak_gib_per_rank": pair[False]["peak_allocated_gib_per_rank"],
                "patched_peak_gib_per_rank": pair[True]["peak_allocated_gib_per_rank"],
                "parity_ok": found.get("parity_passed", found.get("parity", {}).get("passed")),
                "device": f"{found['world_size']}x {found['device']}",
                "source": path.name,
            }
        )
    return rows


def _context_parallel_rows(path: Path) -> list[dict]:
    found = json.loads(path.read_text())

    def peaks(variant: str) -> list[float]:
        return found[variant]["peak_allocated_gib_per_rank"]

    return [
        {
            "setting": "HF Trainer, context parallelism (cp_size=2, FSDP2)",
            "row": f"h1024_l4, {found['sequences_per_step']}x{found['seq_len']} tokens per step",
            "unpatched_step_ms": found["unpatched_step_ms"],
            "patched_step_ms": found["patched_step_ms"],
            "paired_ratio": found.get("patched_over_unpatched_paired", {}).get("median"),
            "unpatched_peak_gib_per_rank": peaks("unpatched"),
            "patched_peak_gib_per_rank": peaks("patched"),
            "parity_ok": found["parity_ok"],
            "device": f"{found['world_size']}x {found['device']}",
            "source": path.name,
        }
    ]


SOURCES = {
    "zero3_h1024.json": _deepspeed_rows,
    "zero3.json": _deepspeed_rows,
    "zero3_sft.json": _deepspeed_rows,
    "zero2.json": _deepspeed_rows,
    "zero3_offload.json": _deepspeed_rows,
    "distributed_gpu.json": lambda p: _paired_runs(
        p, "memory_fsdp2_llama_3_2_1b_shape", "FSDP2 (torch loop)"
    ),
    "tp_gpu.json": lambda p: _paired_runs(
        p, "memory_tp_llama_3_2_1b_shape", "tensor parallelism (tp_plan auto)"
    ),
    "cp_gpu.json": _context_parallel_rows,
}


def markdown(rows: list[dict]) -> str:
    lines = [
        "| setting | row | unpatched step | patched step | patched / unpatched (paired) | peak per rank, "
        "unpatched → patched | parity | device |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['row']} | {r['error']} | | | | | |")
            continue
        ratio = f"{r['patched_step_ms'] / r['unpatched_step_ms']:.3f}"
        if r.get("paired_ratio") is not None:  # each segment against its unpatched neighbours
            ratio += f" ({r['paired_ratio']:.3f})"
        peak_u, peak_p = max(r["unpatched_peak_gib_per_rank"]), max(r["patched_peak_gib_per_rank"])
        lines.append(
            f"| {r['setting']} | {r['row']} | {r['unpatched_step_ms']:.1f} ms | "
            f"{r['patched_step_ms']:.1f} ms | {ratio} | "
            f"{peak_u:.2f} → {peak_p:.2f} GiB ({peak_p / peak_u - 1:+.0%}) | "
            f"{'ok' if r['parity_ok'] else 'FAIL'} | {r['device']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("docs/results"))
    args = parser.parse_args()
    rows: list[dict] = []
    for name, read in SOURCES.items():
        path = args.results / name
        rows += read(path) if path.exists() else [{"setting": name, "row": "-", "error": "no results file"}]
    (args.results / "distributed_speed.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    (args.results / "distributed_speed.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
