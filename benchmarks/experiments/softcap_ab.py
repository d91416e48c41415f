"""Probe: median fwd+bwd ms of the op with softcap off and at 30, at a Gemma-2-like shape.

Times whichever liger_patch is first on PYTHONPATH, so an A/B runs it twice in one device call,
interleaved, e.g. with a checkout of the base commit in ``base/``:

    for i in 1 2; do for p in base .; do PYTHONPATH=$p python benchmarks/experiments/softcap_ab.py; done; done

bf16 inputs, 20 % of labels ignored, logits with a std of about 3 (docs/perf-notes.md item 22).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import bench, make_inputs, need_cuda  # noqa: E402

import liger_patch as lp  # noqa: E402

N, H, V = 8192, 2304, 256000


def main() -> int:
    if not need_cuda("benchmarks/experiments/softcap_ab.py"):
        return 2
    hidden, weight, labels = make_inputs(N, H, V, ignore_frac=0.2, logit_std=3.0)
    out = {"liger_patch": lp.__file__}
    for softcap in (None, 30.0):

        def step(softcap=softcap):
            hidden.grad = weight.grad = None
            lp.fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap).backward()

        out[f"softcap={softcap}"] = bench(step, 1500)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
