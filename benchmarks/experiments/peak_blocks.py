"""Which tensors are alive at a training step's memory peak: the allocator's history of one
steady-state step (``torch.cuda.memory._record_memory_history``), replayed to the moment its
requested bytes peak, listed by where each live tensor was allocated.

    python benchmarks/experiments/peak_blocks.py llama1b_8x2048 liger_patch liger_kernel
    IGNORE_FRAC=0.25 python benchmarks/experiments/peak_blocks.py llama1b_8x2048 liger_patch liger_kernel

``IGNORE_FRAC`` masks that share of every sequence's first labels (``e2e.make_labels``).
``BETWEEN_STEPS=1`` lists instead what stays allocated between steps: the history is recorded from
before the model is built, and after three steps every live block under 1 MiB is listed with
where it was made (the e2e peaks' last 4 requested bytes were of this kind). Besides
the small tensors, each line gives where the peak's last allocation was made (``peak_at``) and
the live tensors of 1 MiB or more, summed by where they were made (``large``).

Each variant runs in its own process (``e2e.build``: model, AdamW, one batch; two warm-up
steps, then the recorded step). Prints one JSON line per variant: the peak's requested bytes
over the step's start, and the live tensors under 1 MiB (size, allocating frames) that are not
parameters of the step's start; then, for two variants, the small live tensors of each that
the other lacks (by size and innermost project frame).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common and e2e
from common import need_cuda  # noqa: E402
from e2e import ROWS, VARIANTS, build, make_labels, train_step  # noqa: E402

SMALL = 1 << 20


def _where(frames: list[dict]) -> str:
    """The innermost frames that are not torch's own: where the tensor was made."""
    own = [f for f in frames if "/torch/" not in f["filename"] or "/liger" in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in own[:4])


def live_at_peak(trace: list[dict]) -> tuple[int, list[tuple[int, str]]]:
    """Replay alloc/free events; the peak of the summed live sizes and what is live there."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: list[tuple[int, str]] = []
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
                at_peak.append((0, "PEAK_AT " + live[event["addr"]][1]))
        elif action == "free_requested" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    return peak, at_peak


def record(row: str, variant: str) -> dict:
    import torch

    model, opt, ids = build(row, variant)
    labels = make_labels(ids, float(os.environ.get("IGNORE_FRAC", "0")))
    amp = ROWS[row][5]
    for _ in range(2):
        train_step(model, opt, ids, amp, labels)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    train_step(model, opt, ids, amp, labels)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, at_peak = live_at_peak(snapshot["device_traces"][0])
    peak_at = at_peak.pop()[1][len("PEAK_AT ") :]
    small = collections.Counter((size, where) for size, where in at_peak if size < SMALL)
    large = collections.Counter()
    for size, where in at_peak:
        if size >= SMALL:
            large[where] += size
    return {
        "row": row,
        "variant": variant,
        "peak_over_start": peak,
        "peak_at": peak_at,
        "large_mib": sorted(((n / 2**20, w) for w, n in large.items()), reverse=True),
        "live_at_peak": len(at_peak),
        "small": [[size, where, n] for (size, where), n in sorted(small.items())],
    }


def record_between(row: str, variant: str) -> dict:
    """The blocks under 1 MiB alive after three steps, by requested size and where made."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    model, opt, ids = build(row, variant)
    labels = make_labels(ids, float(os.environ.get("IGNORE_FRAC", "0")))
    for _ in range(3):
        train_step(model, opt, ids, ROWS[row][5], labels)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    small = collections.Counter(
        (block["requested_size"], _where(block.get("frames", [])))
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated" and block["requested_size"] < SMALL
    )
    return {
        "row": row,
        "variant": variant,
        "between_steps": True,
        "allocated": torch.cuda.memory_allocated(),
        "small": [[size, where, n] for (size, where), n in sorted(small.items())],
    }


def main(argv: list[str]) -> None:
    row, variants = argv[0], argv[1:]
    if len(argv) > 1 and argv[1] == "--one":
        measure = record_between if os.environ.get("BETWEEN_STEPS") == "1" else record
        print(json.dumps(measure(argv[0], argv[2])), flush=True)
        return
    results = []
    for variant in variants:
        out = subprocess.run(
            [sys.executable, __file__, row, "--one", variant], check=True, capture_output=True, text=True
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    if len(results) == 2:
        a, b = (collections.Counter({(s, w): n for s, w, n in r["small"]}) for r in results)
        print(
            json.dumps(
                {
                    f"only_{results[0]['variant']}": sorted((a - b).items()),
                    f"only_{results[1]['variant']}": sorted((b - a).items()),
                    "peak_difference": results[0].get("peak_over_start", 0)
                    - results[1].get("peak_over_start", 0),
                },
                default=str,
            ),
            flush=True,
        )


if __name__ == "__main__":
    args = sys.argv[1:]
    one = len(args) == 3 and args[1] == "--one"
    if not one and (len(args) < 2 or args[0] not in ROWS or any(v not in VARIANTS for v in args[1:])):
        print(__doc__, f"ROW: one of {', '.join(ROWS)}; VARIANT: of {', '.join(VARIANTS)}", sep="\n")
        sys.exit(2)
    if not need_cuda("benchmarks/experiments/peak_blocks.py"):
        sys.exit(2)
    main(args)
