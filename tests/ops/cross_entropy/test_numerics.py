"""Numerical corners, each once a silent wrong answer: gradients scaled by an upstream that is
not 1 in bf16, huge logits without z-loss, the softcap's tanh in fp32, second derivatives, and a
hidden size of 0."""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from op_helpers import BACKENDS, TOL, assert_close, call_op, call_raw, make_case, reference_for

from liger_patch.ops.reference import reference_flce

FP32 = TOL[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_gradients_scaled_by_upstream_round_to_nearest(gen, device, backend):
    """The forward's scale-1 gradients times an upstream of 0.37 must be the fp32 product rounded
    to nearest, bit for bit: truncation (the interpreter's bf16 narrowing) biased them toward 0."""
    case = make_case(gen, (4, 33), 24, 96, dtype=torch.bfloat16, device=device, bias=True)
    call_op(case, backend=backend).backward()
    unit = {k: t.grad.clone() for k, t in case.tensors().items()}
    for t in case.tensors().values():
        t.grad = None
    loss = call_op(case, backend=backend)
    (loss * 0.37).backward()
    scale = torch.tensor(0.37, dtype=loss.dtype).float()  # the upstream as autograd passes it
    for name, t in case.tensors().items():
        expected = (unit[name].float() * scale).to(torch.bfloat16)
        assert torch.equal(t.grad, expected), f"grad {name} is not the product rounded to nearest"


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_logits_without_z_loss_stay_finite(device, backend, reduction):
    """|lse| > 1.8e19 squares to inf in fp32; with z_loss_scale=0 that must not make 0 * inf = NaN.
    The fp64 reference gives the loss (0 here: the winning logits are 2e20, far beyond fp32's
    resolution of log 2)."""
    hidden = torch.full((2, 2), 1e10, device=device, requires_grad=True)
    weight = torch.tensor([[-1e10, -1e10], [1e10, 1e10], [1e10, 1e10]], device=device)
    labels = torch.tensor([1, 2], device=device)
    loss, z = call_raw(hidden, weight, labels, backend=backend, reduction=reduction, return_z_loss=True)
    ref, _ = reference_flce(
        hidden.detach().double().cpu(), weight.double().cpu(), labels.cpu(), reduction=reduction
    )
    assert torch.isfinite(loss).all() and torch.equal(z, torch.zeros_like(z))
    assert_close("loss", loss, ref, FP32)
    loss.sum().backward()
    assert torch.isfinite(hidden.grad).all()


def _softcap_kernel(x_ptr, z_ptr, d_ptr, cap, n, SOFTCAP_FN: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    z, d = SOFTCAP_FN(tl.load(x_ptr + offsets, mask=mask, other=0.0), cap)
    tl.store(z_ptr + offsets, z, mask=mask)
    tl.store(d_ptr + offsets, d, mask=mask)


def test_triton_softcap_is_accurate_to_a_few_ulp(device):
    """The kernels' ``cap * tanh(x / cap)`` and ``1 - tanh^2`` against fp64, element by element,
    over |x / cap| from 1e-7 to 40. ``2 sigmoid(2u) - 1`` (before) was 3e-4 off relative at
    u = 1e-4, and fp32 ``1 - t * t`` loses most digits once tanh saturates."""
    from liger_patch.ops.core.triton.common import jitted, softcap

    cap = 7.0
    mags = torch.logspace(-7, math.log10(40.0), 2000, dtype=torch.float64)
    u = torch.cat([mags, -mags, torch.zeros(1, dtype=torch.float64)])
    x = (u * cap).float().to(device)
    z, d = torch.empty_like(x), torch.empty_like(x)
    kernel = triton.jit(_softcap_kernel)
    grid = (triton.cdiv(x.numel(), 256),)
    kernel[grid](x, z, d, cap, x.numel(), SOFTCAP_FN=jitted(softcap), BLOCK=256)
    t = torch.tanh(x.double().cpu() / cap)
    want_z, want_d = cap * t, 1.0 / torch.cosh(x.double().cpu() / cap) ** 2
    torch.testing.assert_close(z.cpu().double(), want_z, rtol=4e-7, atol=0.0)
    # exp(-2|u|) in fp32 is off by up to ~|2u| ulp whatever the exp (its argument is rounded):
    # the derivative's bound grows with |u| (the GPU's exp adds its own ~2 ulp).
    rel = (d.cpu().double() - want_d).abs() / want_d
    bound = 2e-6 + 4 * u.abs() * 2.0**-24
    assert (rel <= bound).all(), f"1 - tanh^2 off by {float((rel / bound).max()):.3g}x its bound"


@pytest.mark.parametrize("softcap", [30.0, 3.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_fp32_to_1e6(gen, device, chunk_rows, backend, softcap):
    """liger-kernel's own fp32 softcap test holds gradients to rtol 1e-6, for a cap that keeps
    tanh near linear and for one that saturates it."""
    tuned = chunk_rows(16, 100)
    case = make_case(gen, (3, 17), 16, 100, device=device, bias=True, logit_std=3.0)
    opts = dict(backend=backend, softcap=softcap, logit_scale=1.7, reduction="sum")
    loss = call_op(case, **opts, **tuned)
    ref, _, leaves = reference_for(case, **opts)
    assert_close("loss", loss, ref, 1e-6)
    loss.backward()
    ref_grads = torch.autograd.grad(ref, list(leaves.values()))
    for (name, t), want in zip(case.tensors().items(), ref_grads, strict=True):
        assert_close(f"grad {name}", t.grad, want, 1e-6)


DOUBLE_BACKWARD_OPTIONS = {
    "plain": {},
    "all_options": dict(label_smoothing=0.1, z_loss_scale=1e-2, softcap=5.0, logit_scale=0.8),
}


@pytest.mark.parametrize("opts_id", list(DOUBLE_BACKWARD_OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_gradient_penalty(gen, device, backend, reduction, opts_id):
    """``create_graph=True`` then a gradient penalty: the first-order gradient must stay attached
    to the graph (it came back detached, and h.grad was silently wrong: 0.138 vs 0.290)."""
    opts = dict(DOUBLE_BACKWARD_OPTIONS[opts_id], reduction=reduction, return_z_loss=True)
    case = make_case(gen, (2, 5), 7, 11, device=device, bias=True)
    ref, ref_z, leaves = reference_for(case, **opts)
    upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    z_upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)

    def penalised(loss, z, tensors, up, z_up):
        objective = (loss * up).sum() + (z * z_up).sum()
        grads = torch.autograd.grad(objective, tensors, create_graph=True)
        return objective + sum(g.pow(2).sum() for g in grads), grads

    tensors = list(case.tensors().values())
    loss, z = call_op(case, backend=backend, **opts)
    total, first = penalised(loss, z, tensors, upstream.to(device).float(), z_upstream.to(device).float())
    total.backward()
    ref_total, ref_first = penalised(ref, ref_z, list(leaves.values()), upstream, z_upstream)
    ref_second = torch.autograd.grad(ref_total, list(leaves.values()))
    for name, got, want in zip(case.tensors(), first, ref_first, strict=True):
        assert_close(f"first-order grad {name}", got, want, FP32)
    for (name, t), want in zip(case.tensors().items(), ref_second, strict=True):
        assert_close(f"grad of the penalised loss, {name}", t.grad, want, FP32)


def test_double_backward_matches_torch_cross_entropy(gen, device):
    """The issue's own numbers: the gradient penalty through F.cross_entropy, as ground truth."""
    h = torch.randn(4, 5, generator=gen).to(device).requires_grad_()
    w = torch.randn(7, 5, generator=gen).to(device)
    y = torch.randint(0, 7, (4,), generator=gen).to(device)
    results = []
    for loss_fn in (lambda: call_raw(h, w, y), lambda: F.cross_entropy(h @ w.t(), y)):
        h.grad = None
        loss = loss_fn()
        (gh,) = torch.autograd.grad(loss, h, create_graph=True)
        (loss + gh.pow(2).sum()).backward()
        results.append(h.grad.clone())
    assert_close("h.grad", results[0], results[1].double(), FP32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_size_zero(gen, device, backend, reduction):
    """H = 0: every logit is the bias (or 0), so the loss is log V without one, as torch says."""
    hidden = torch.empty(3, 0, device=device, requires_grad=True)
    weight = torch.empty(5, 0, device=device, requires_grad=True)
    bias = torch.randn(5, generator=gen).to(device).requires_grad_()
    labels = torch.tensor([1, -100, 4], device=device)
    plain = call_raw(hidden, weight, labels, backend=backend, reduction=reduction)
    expected = F.cross_entropy(torch.zeros(3, 5, device=device), labels, reduction=reduction)
    assert_close("loss without bias", plain, expected.double(), FP32)
    loss = call_raw(hidden, weight, labels, bias, backend=backend, reduction=reduction)
    ref_bias = bias.detach().cpu().double().requires_grad_()
    ref, _ = reference_flce(
        hidden.detach().cpu().double(),
        weight.detach().cpu().double(),
        labels.cpu(),
        ref_bias,
        reduction=reduction,
    )
    assert_close("loss with bias", loss, ref, FP32)
    loss.sum().backward()
    ref.sum().backward()
    assert hidden.grad.shape == (3, 0) and weight.grad.shape == (5, 0)
    assert_close("grad bias", bias.grad, ref_bias.grad, FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_saturated_softcap_keeps_its_gradient(device, backend):
    """Past |x / cap| ~ 9, fp32 ``1 - tanh^2`` is exactly 0; the true derivative is not (found by
    the fuzz suite on the torch backend)."""
    h = torch.tensor([[1.0], [-0.5]], device=device)
    w = torch.tensor([[20.0], [-17.0]], device=device, requires_grad=True)
    labels = torch.tensor([0, 0], device=device)
    call_raw(h, w, labels, backend=backend, reduction="sum", softcap=1.0).backward()
    w64 = w.detach().cpu().double().requires_grad_()
    ref, _ = reference_flce(h.cpu().double(), w64, labels.cpu(), reduction="sum", softcap=1.0)
    ref.backward()
    torch.testing.assert_close(w.grad.cpu().double(), w64.grad, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recomputed_logits_above_the_saved_lse_stay_finite(gen, device, backend):
    """The two-pass path recomputes logits with another GEMM than the one the log-sum-exp came
    from; at logits of ~1e13 one rounding apart, exp(z - lse) overflowed to inf (fuzz finding)."""
    h = torch.randn(600, 8, generator=gen).to(device)
    w = (torch.randn(3, 8, generator=gen) * 1e12).to(device).requires_grad_()
    y = torch.randint(0, 3, (600,), generator=gen).to(device)
    budget = (2 << 20) + 32 * 600 + 8 * 3 * 4  # a few rows per chunk: the two-pass path
    call_raw(h, w, y, backend=backend, reduction="sum", memory_budget=budget).backward()
    assert torch.isfinite(w.grad).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_with_hidden_a_view_of_weight(gen, device, backend):
    """create_graph=True where hidden = weight[:N]: the first-order gradient must not count the
    path through hidden twice (fuzz finding: off by ~1 before)."""
    w = torch.randn(5, 3, generator=gen).to(device).requires_grad_()
    y = torch.tensor([1, 4], device=device)
    (plain,) = torch.autograd.grad(call_raw(w[:2], w, y, backend=backend), w)
    (graph,) = torch.autograd.grad(call_raw(w[:2], w, y, backend=backend), w, create_graph=True)
    w64 = w.detach().cpu().double().requires_grad_()
    (ref,) = torch.autograd.grad(reference_flce(w64[:2], w64, y.cpu())[0], w64)
    assert_close("grad, create_graph=True", graph, ref, FP32)
    assert_close("grad", plain, ref, FP32)
