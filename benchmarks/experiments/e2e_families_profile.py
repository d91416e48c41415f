"""Where a patched encoder-decoder or speech step loses time: one steady step of an
``e2e_families.py`` row, unpatched and patched, under ``torch.profiler`` (CPU and CUDA).

Per variant: the step's wall time (synchronised), the GPU's busy time (kernels summed), the host
time spent waiting on the GPU (``cudaStreamSynchronize``, ``cudaEventSynchronize``,
``cudaDeviceSynchronize`` and synchronous copies), the kernel count, and the kernels whose summed
time differs most between the variants.

    python benchmarks/experiments/e2e_families_profile.py --rows mt5_base_seq2seq,whisper_small \\
        --out benchmarks/experiments/results/e2e_families_profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import environment, need_cuda, profiled_step, write_json  # noqa: E402
from e2e_families import ROWS, build_model, make_batch  # noqa: E402


def _step(model, opt, batch) -> None:
    torch.manual_seed(2)
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _profiled(model, opt, batch) -> dict:
    """One step under the profiler after two unprofiled ones: its figures and kernels."""
    for _ in range(2):
        _step(model, opt, batch)
    found = profiled_step(lambda: _step(model, opt, batch))
    kernels = found["kernel_ms"]
    return {"wall_ms": found["wall_ms"], "gpu_busy_ms": sum(kernels.values()),
            "host_wait_ms": dict(found["host_wait_ms"]), "kernels": found["kernels"],
            "by_kernel": kernels}  # fmt: skip


def profile_row(name: str) -> dict:
    """The row's model, unpatched then patched, one profiled step each."""
    import liger_patch as lp

    row = ROWS[name]
    model = build_model(row, "cuda", torch.bfloat16)
    batch = make_batch(row, model.config.vocab_size, "cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    unpatched = _profiled(model, opt, batch)
    lp.apply_liger_to(model)
    patched = _profiled(model, opt, batch)
    names = set(unpatched["by_kernel"]) | set(patched["by_kernel"])
    diff = {k: patched["by_kernel"].get(k, 0.0) - unpatched["by_kernel"].get(k, 0.0) for k in names}
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]
    for variant in (unpatched, patched):
        del variant["by_kernel"]
    return {"row": name, "unpatched": unpatched, "patched": patched,
            "kernel_ms_patched_minus_unpatched": dict(top)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="mt5_base_seq2seq,whisper_small")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not need_cuda(__file__):
        return 2
    results = []
    for name in args.rows.split(","):
        results.append(profile_row(name))
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.out:
        write_json(args.out, {**environment("transformers"), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
