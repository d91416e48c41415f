"""grad_W across chunks: kept in fp32, or (when an fp32 copy would not fit the memory budget)
accumulated in the weight's own dtype. Both must match the fp64 reference; the second within
the rounding that one bf16 addition per chunk allows."""

import pytest
import torch
from op_helpers import make_case, reference_for

from liger_patch.ops import chunked
from liger_patch.ops.chunked import run_chunks
from liger_patch.ops.options import LossOptions
from liger_patch.ops.torch_ce import ce_rows_torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double().cpu() - b).norm() / b.norm())


# CPU runs the GEMMs on fp32 gradients; CUDA rounds them to bf16 first (tensor cores), which
# adds about one more bf16 rounding to every term.
TOLERANCE = {("cpu", True): 2.5e-3, ("cpu", False): 6e-3, ("cuda", True): 2.5e-3, ("cuda", False): 1.5e-2}


@pytest.mark.parametrize("fp32_grad_weight", [True, False])
def test_grad_weight_accumulation_modes(gen, device, fp32_grad_weight):
    tol = TOLERANCE[(device.type, fp32_grad_weight)]
    rows_per_chunk, vocab = 5, 89
    case = make_case(gen, (47,), 24, vocab, dtype=torch.bfloat16, device=device, requires_grad=("weight",))
    ref, _, leaves = reference_for(case, reduction="sum")
    ref.backward()
    res = run_chunks(
        ce_rows_torch,
        case.hidden.reshape(-1, 24),
        case.weight,
        None,
        case.labels.reshape(-1),
        LossOptions(),
        budget_bytes=4 * vocab * rows_per_chunk,
        coef_ce=(case.labels.reshape(-1) != -100).float(),
        coef_z=torch.zeros(47, device=device),
        need_weight=True,
        fp32_grad_weight=fp32_grad_weight,
        logits_dtype=torch.float32,  # isolate the accumulation's rounding from the logits'
    )
    assert res.grad_weight.dtype == torch.bfloat16
    assert _rel(res.grad_weight, leaves["weight"].grad) < tol


def test_auto_mode_keeps_fp32_when_it_fits_the_budget(gen, device, monkeypatch):
    """With the default (auto) rule, a budget that holds an fp32 grad_W next to chunks of
    MIN_TOKEN_CHUNK_ROWS rows keeps the sum exact in fp32 until the final rounding, so the result
    equals fp32 accumulation bit for bit."""
    monkeypatch.setattr(chunked, "MIN_TOKEN_CHUNK_ROWS", 4)
    case = make_case(gen, (30,), 16, 64, dtype=torch.bfloat16, device=device, requires_grad=("weight",))
    args = (
        ce_rows_torch,
        case.hidden.reshape(-1, 16),
        case.weight,
        None,
        case.labels.reshape(-1),
        LossOptions(),
    )
    coef = dict(
        coef_ce=torch.ones(30, device=device), coef_z=torch.zeros(30, device=device), need_weight=True
    )
    budget = 4 * 64 * 16 + 2 * 64 * 4  # an fp32 grad_W, and 4 rows of bf16 logits: 8 chunks
    auto = run_chunks(*args, budget_bytes=budget, **coef)
    fp32 = run_chunks(*args, budget_bytes=budget, fp32_grad_weight=True, **coef)
    assert torch.equal(auto.grad_weight, fp32.grad_weight)
