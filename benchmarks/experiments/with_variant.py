"""Probe: run a benchmark script with one of ``zero3_variants``' set-ups applied for the whole
run, in every process (the script is run as ``__main__``, so ``torchrun`` can launch this file).
For scripts that time patched against unpatched in one process without ``zero3_gpu.py``'s
``--variants`` (``cp_gpu.py``, ``tp_gpu.py``, ``distributed_gpu.py``)::

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. torchrun --nproc-per-node 2 \\
        benchmarks/experiments/with_variant.py never_wait_to_skip benchmarks/cp_gpu.py --out DIR
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for experiments.*

from experiments import zero3_variants  # noqa: E402


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: with_variant.py VARIANT SCRIPT [ARGS...]")
    variant, script = sys.argv[1], sys.argv[2]
    setup = getattr(zero3_variants, variant, None)
    if setup is None:
        raise SystemExit(f"zero3_variants has no set-up {variant!r}")
    setup()
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
