"""The backward's two paths: gradients precomputed in the forward (mean/sum, bf16/fp32) and
recomputed in the backward (fp16, reduction "none", a gradient through z_loss, a second backward
over a retained graph). Each path must give the reference gradients."""

import pytest
import torch
from op_helpers import BACKENDS, TOL, assert_close, call_op, make_case, reference_for


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_second_backward_over_retained_graph(gen, device, chunk_rows, backend, reduction):
    """The first backward consumes the precomputed gradients; the second must recompute them."""
    tuned = chunk_rows(4, 61)
    case = make_case(gen, (3, 5), 13, 61, device=device, bias=True)
    opts = dict(backend=backend, reduction=reduction, z_loss_scale=1e-2, softcap=5.0)
    scaled = call_op(case, **opts, **tuned) * 0.7  # an upstream gradient != 1 exposes double scaling
    scaled.backward(retain_graph=True)
    scaled.backward()
    ref, _, leaves = reference_for(case, **opts)
    (ref * 0.7).backward()
    for name, leaf in leaves.items():
        assert_close(f"grad {name}", case.tensors()[name].grad, 2 * leaf.grad, TOL[torch.float32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_gradients_scaled_like_gradscaler_do_not_underflow(gen, device, chunk_rows, backend):
    """fp16 gradients of a mean over many tokens are tiny; a GradScaler multiplies the loss by
    2**16 so they survive in fp16. Scaling after rounding (what precomputing in the forward would
    do) would flush them to zero first, so fp16 takes the recompute path."""
    tuned = chunk_rows(16, 37)
    case = make_case(gen, (96,), 8, 37, dtype=torch.float16, device=device)
    scale, items = 2.0**24, 50_000_000
    loss = call_op(case, backend=backend, num_items_in_batch=items, **tuned)
    (loss * scale).backward()
    ref, _, leaves = reference_for(case, num_items_in_batch=items)
    (ref * scale).backward()
    for name, leaf in leaves.items():
        got = case.tensors()[name].grad
        expected = leaf.grad
        # Unscaled, most of these gradients are below fp16's smallest subnormal (6e-8).
        nonzero = (expected / scale).abs()[expected != 0]
        assert float(nonzero.median()) < 6e-8
        assert_close(f"grad {name}", got, expected, TOL[torch.float16])


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_refuses_a_weight_freed_after_the_forward(gen, device, backend):
    """A sharding wrapper may empty the weight between forward and backward (DeepSpeed ZeRO-3's
    ``param.data = torch.empty(0)``): the recompute path says so instead of failing in a kernel.
    The precomputed path never reads the weight again (checked with the weight whole once more:
    PyTorch itself refuses to accumulate a gradient into an emptied parameter)."""
    case = make_case(gen, (7,), 8, 29, device=device, bias=True)
    weight, bias = case.tensors()["weight"], case.tensors()["bias"]
    rows = call_op(case, backend=backend, reduction="none")  # recomputes in the backward
    mean = call_op(case, backend=backend)  # precomputed in the forward
    whole = weight.data
    weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    with pytest.raises(RuntimeError, match=r"the forward saved, of shapes \(\(29, 8\), \(29,\)\) then"):
        rows.sum().backward()
    weight.data = whole
    mean.backward()
    assert weight.grad is not None and weight.grad.shape == whole.shape and bias.grad.shape == (29,)
