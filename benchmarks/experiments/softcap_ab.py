"""Probe: median fwd+bwd ms of the op with softcap off and at 30, at a Gemma-2-like shape.

Times whichever liger_patch is first on PYTHONPATH, so an A/B runs it twice in one device call,
interleaved, e.g. with a checkout of the base commit in ``base/``:

    for i in 1 2; do for p in base .; do PYTHONPATH=$p python benchmarks/experiments/softcap_ab.py; done; done

bf16 inputs, 20 % of labels ignored, logits with a std of about 3 (docs/perf-notes.md item 22).
"""

import json
import math

import torch
import triton

import liger_patch as lp

N, H, V = 8192, 2304, 256000


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=gen) * (3 / math.sqrt(H))
    weight.requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda", generator=gen)
    labels[torch.rand(N, device="cuda", generator=gen) < 0.2] = -100
    out = {"liger_patch": lp.__file__}
    for softcap in (None, 30.0):

        def step(softcap=softcap):
            hidden.grad = weight.grad = None
            lp.fused_linear_cross_entropy(hidden, weight, labels, softcap=softcap).backward()

        out[f"softcap={softcap}"] = triton.testing.do_bench(step, rep=1500, return_mode="median")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
