"""grad_W across chunks: kept in fp32, or (when an fp32 copy would not fit the memory budget)
accumulated in the weight's own dtype. Both must match the fp64 reference; the second within
the rounding that one bf16 addition per chunk allows."""

import pytest
import torch
from op_helpers import chunk_call, make_case, reference_for

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.chunks import run_chunks
from liger_patch.ops.cross_entropy.options import LossOptions

TORCH = row_backend("torch", torch.device("cpu"))


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
    opts = LossOptions(
        logits_dtype=torch.float32,  # isolate the accumulation's rounding from the logits'
        tuning=Tuning(fp32_grad_weight=fp32_grad_weight),
    )
    res = run_chunks(
        chunk_call(
            TORCH,
            case.hidden.reshape(-1, 24),
            case.weight,
            None,
            case.labels.reshape(-1),
            opts,
            budget_bytes=4 * vocab * rows_per_chunk,
            coef_ce=(case.labels.reshape(-1) != -100).float(),
            coef_z=torch.zeros(47, device=device),
            need_weight=True,
        )
    )
    assert res.grad_weight.dtype == torch.bfloat16
    assert _rel(res.grad_weight, leaves["weight"].grad) < tol


def test_auto_mode_keeps_fp32_when_it_fits_the_budget(gen, device):
    """With the default (auto) rule, a budget that holds an fp32 grad_W next to chunks of
    ``min_token_chunk_rows`` rows keeps the sum exact in fp32 until the final rounding, so the
    result equals fp32 accumulation bit for bit."""
    case = make_case(gen, (30,), 16, 64, dtype=torch.bfloat16, device=device, requires_grad=("weight",))
    hidden, labels = case.hidden.reshape(-1, 16), case.labels.reshape(-1)
    auto_opts = LossOptions(tuning=Tuning(min_token_chunk_rows=4))
    fp32_opts = LossOptions(tuning=Tuning(min_token_chunk_rows=4, fp32_grad_weight=True))
    coef = dict(
        coef_ce=torch.ones(30, device=device), coef_z=torch.zeros(30, device=device), need_weight=True
    )
    budget = 4 * 64 * 16 + 2 * 64 * 4  # an fp32 grad_W, and 4 rows of bf16 logits: 8 chunks
    auto = run_chunks(
        chunk_call(TORCH, hidden, case.weight, None, labels, auto_opts, budget_bytes=budget, **coef)
    )
    fp32 = run_chunks(
        chunk_call(TORCH, hidden, case.weight, None, labels, fp32_opts, budget_bytes=budget, **coef)
    )
    assert torch.equal(auto.grad_weight, fp32.grad_weight)
