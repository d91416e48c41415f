"""``logits_dtype``: logits chunks stored in the input dtype (the default, as an unpatched head
stores them) or in fp32. Same math either way: values and gradients match the fp64 reference
within the input dtype's rounding, on both chunk paths."""

import pytest
import torch
from op_helpers import BACKENDS, TOL, call_op, check_parity, make_case, record_calls

from liger_patch.ops.cross_entropy import chunks as chunked


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("logits_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_dtype_parity(gen, device, chunk_rows, backend, reduction, dtype, logits_dtype, two_pass):
    tuned = chunk_rows(5, 83, two_pass=two_pass)
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
        logits_dtype=logits_dtype,
        **tuned,
    )


def test_logits_are_stored_in_the_chosen_dtype(gen, device, monkeypatch):
    """The chunk the row kernel sees has the requested dtype (a test that the option is wired)."""
    seen = record_calls(monkeypatch, chunked, "_chunk_logits", lambda args, kwargs, out: out.logits.dtype)
    case = make_case(gen, (9,), 16, 40, dtype=torch.bfloat16, device=device)
    call_op(case)
    call_op(case, logits_dtype=torch.float32)
    assert seen == [torch.bfloat16, torch.float32]
