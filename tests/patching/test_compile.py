"""The whole patched model under torch.compile equals eager (loss and gradients)."""

from __future__ import annotations

import copy

import pytest
import torch

import liger_patch as lp
from tests.patching_helpers import device_and_dtype, make_batch, tiny_model

# CPU: aot_eager traces the patched forward and the op's autograd.Function through dynamo and
# AOTAutograd in a few seconds; on CUDA the real inductor backend runs.
BACKEND = "inductor" if torch.cuda.is_available() else "aot_eager"


def test_compiled_patched_model_equals_eager():
    torch._dynamo.reset()
    eager = tiny_model("llama")
    lp.apply_liger_to(eager)
    compiled_model = copy.deepcopy(eager)
    lp.apply_liger_to(compiled_model)  # deepcopy keeps the patch; re-applying is a no-op
    compiled = torch.compile(compiled_model, backend=BACKEND)
    tol = 1e-5 if device_and_dtype()[1] == torch.float32 else 2e-2
    for seed in range(2):
        batch = make_batch(seed)
        out_eager, out_compiled = eager(**batch), compiled(**batch)
        assert out_compiled.logits is None
        torch.testing.assert_close(out_compiled.loss, out_eager.loss, rtol=tol, atol=tol)
        out_eager.loss.backward()
        out_compiled.loss.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=tol * 10, atol=tol * 10, msg=name)
            p.grad = q.grad = None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_patched_moe_model_equals_eager_bf16():
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    lp.apply_liger_to(model)
    compiled = torch.compile(copy.deepcopy(model))
    batch = make_batch()
    torch.testing.assert_close(compiled(**batch).loss, model(**batch).loss, rtol=2e-2, atol=2e-2)
