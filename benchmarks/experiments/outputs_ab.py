"""Probe: median fwd+bwd ms of the op at the four benchmark shapes, plain and with token accuracy
and entropy requested (when the liger_patch being timed has them).

Times whichever liger_patch is first on PYTHONPATH, so an A/B runs it under two checkouts in one
device call, interleaved, e.g. with a checkout of the base commit in ``.device/base``:

    for i in 1 2; do for p in .device/base .; do
        PYTHONPATH=$p python benchmarks/experiments/outputs_ab.py
    done; done

bf16 inputs, 20 % of labels ignored, logits with a std of about 3 (docs/perf-notes.md item 24).
"""

import inspect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common
from common import SHAPES, bench, make_inputs, need_cuda  # noqa: E402

import liger_patch as lp  # noqa: E402


def main() -> int:
    if not need_cuda("benchmarks/experiments/outputs_ab.py"):
        return 2
    has_outputs = "return_entropy" in inspect.signature(lp.fused_linear_cross_entropy).parameters
    variants = {"plain": {}}
    if has_outputs:
        variants["accuracy+entropy"] = dict(return_token_accuracy=True, return_entropy=True)
    out = {"liger_patch": lp.__file__}
    for name, (n, h, v) in SHAPES.items():
        hidden, weight, labels = make_inputs(n, h, v, ignore_frac=0.2, logit_std=3.0)
        for variant, kwargs in variants.items():

            def step(hidden=hidden, weight=weight, labels=labels, kwargs=kwargs):
                hidden.grad = weight.grad = None
                res = lp.fused_linear_cross_entropy(hidden, weight, labels, **kwargs)
                (res if not kwargs else res.loss).backward()

            out[f"{name} {variant}"] = bench(step, 1500)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
