"""Where a training step's peak memory comes from: peak allocated in the forward, in the backward
and in the optimizer step, for one patch variant (a process per variant, like e2e.py, whose
``build`` makes the model, optimizer and batch).

    python benchmarks/experiments/e2e_memory_phases.py llama1b_8x2048 liger_patch
    python benchmarks/experiments/e2e_memory_phases.py llama1b_8x2048 liger_kernel

Prints one JSON line per step (GiB): allocated at the start, peak and allocated after the
forward, peak and allocated after the backward, peak in the optimizer step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common and e2e
from common import GiB, PeakMemory, need_cuda  # noqa: E402
from e2e import ROWS, VARIANTS, build  # noqa: E402


def main(row: str, variant: str, steps: int = 3) -> None:
    model, opt, ids = build(row, variant)
    for step in range(steps):
        with PeakMemory() as fwd:
            loss = model(input_ids=ids, labels=ids).loss
        with PeakMemory() as bwd:
            loss.backward()
        with PeakMemory() as upd:
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(
            json.dumps(
                dict(
                    row=row,
                    variant=variant,
                    step=step,
                    start=fwd.start / GiB,
                    peak_fwd=fwd.peak / GiB,
                    peak_fwd_requested=fwd.peak_requested / GiB,
                    after_fwd=fwd.end / GiB,
                    peak_bwd=bwd.peak / GiB,
                    peak_bwd_requested=bwd.peak_requested / GiB,
                    after_bwd=bwd.end / GiB,
                    peak_opt=upd.peak / GiB,
                )
            ),
            flush=True,
        )


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ROWS or sys.argv[2] not in VARIANTS:
        print(__doc__, f"ROW: one of {', '.join(ROWS)}; VARIANT: one of {', '.join(VARIANTS)}", sep="\n")
        sys.exit(2)
    if not need_cuda("benchmarks/experiments/e2e_memory_phases.py"):
        sys.exit(2)
    main(*sys.argv[1:3])
