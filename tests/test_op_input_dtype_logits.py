"""The opt-in mode that stores logits chunks in the input dtype (as an unpatched half-precision
head does) instead of fp32: same math, values and gradients within half-precision rounding."""

import pytest
import torch
from op_helpers import BACKENDS, TOL, check_parity, make_case

from liger_patch.ops import fused_linear_ce


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_input_dtype_logits_parity(gen, device, chunk_rows, monkeypatch, backend, reduction, dtype):
    monkeypatch.setattr(fused_linear_ce, "LOGITS_IN_INPUT_DTYPE", True)
    chunk_rows(5, 83)
    case = make_case(gen, (3, 11), 21, 83, dtype=dtype, device=device, bias=True)
    check_parity(
        case,
        gen,
        tol=TOL[dtype],
        backend=backend,
        reduction=reduction,
        z_loss_scale=1e-3,
        softcap=8.0,
        label_smoothing=0.05,
    )
