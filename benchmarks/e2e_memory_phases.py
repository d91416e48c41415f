"""Where a training step's peak memory comes from: peak allocated in the forward, in the backward
and in the optimizer step, for one patch variant (a process per variant, like e2e.py).

    python benchmarks/e2e_memory_phases.py llama1b_8x2048 liger_patch
    python benchmarks/e2e_memory_phases.py llama1b_8x2048 liger_kernel

Prints one JSON line per step (GiB): allocated at the start, peak and allocated after the
forward, peak and allocated after the backward, peak in the optimizer step.
"""

from __future__ import annotations

import json
import sys

import torch
from e2e import build

GiB = 2**30


def main(row: str, variant: str, steps: int = 3) -> None:
    model, opt, ids = build(row, variant)

    def mark() -> tuple[float, float]:
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / GiB, torch.cuda.memory_allocated() / GiB

    for step in range(steps):
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated() / GiB
        loss = model(input_ids=ids, labels=ids).loss
        peak_fwd, after_fwd = mark()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        peak_bwd, after_bwd = mark()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak_opt, _ = mark()
        print(
            json.dumps(
                dict(
                    row=row,
                    variant=variant,
                    step=step,
                    start=start,
                    peak_fwd=peak_fwd,
                    after_fwd=after_fwd,
                    peak_bwd=peak_bwd,
                    after_bwd=after_bwd,
                    peak_opt=peak_opt,
                )
            )
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
