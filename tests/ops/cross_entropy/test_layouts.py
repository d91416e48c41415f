"""Inputs in every memory layout give the fp64 answer: strided, expanded (stride 0), transposed
and aliased hidden, weight, bias and labels, on both backends (Triton under the interpreter on CPU).

Regressions: the Triton row kernel read labels as if contiguous (wrong loss for ``y[::2]``, a
segfault for an expanded scalar); its backward refused a transposed hidden (``scale_ needs
contiguous tensors``); the fused logits GEMM read a strided fp32 bias by column.
"""

import pytest
import torch
from op_helpers import BACKENDS, TOL, assert_close, call_raw

from liger_patch.ops.reference import reference_flce

FP32 = TOL[torch.float32]


def _check(leaves, views, labels, backend, gen, **opts):
    """Op vs fp64 reference on ``views(*leaves) -> (hidden, weight, bias)``: the loss, and the
    gradients of the leaves (so rows that share storage, or a hidden that aliases the weight,
    get their summed gradient on both sides)."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    refs = [t.detach().cpu().double().requires_grad_() for t in leaves]
    loss = call_raw(*views(*leaves)[:2], labels, views(*leaves)[2], backend=backend, **opts)
    ref_h, ref_w, ref_b = views(*refs)
    ref, _ = reference_flce(ref_h, ref_w, labels.cpu(), ref_b, **opts)
    assert_close("loss", loss, ref, FP32)
    upstream = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    (loss * upstream.to(loss.device, loss.dtype)).sum().backward()
    (ref * upstream).sum().backward()
    for got, want in zip(leaves, refs, strict=True):
        # Some of these gradients are exactly 0 in exact arithmetic (a bias or weight row shared
        # by every class sums softmax - target over the vocabulary): fp32 leaves ~1e-8 there.
        atol = FP32 * max(float(want.grad.abs().max()), 0.1)
        torch.testing.assert_close(got.grad.cpu().double(), want.grad, rtol=FP32, atol=atol)
    return leaves


def _base(gen, device, n=12, H=24, V=32):
    h = torch.randn(n, H, generator=gen).to(device)
    w = (torch.randn(V, H, generator=gen) * 0.4).to(device)
    b = torch.randn(V, generator=gen).to(device)
    y = torch.randint(0, V, (n,), generator=gen)
    y[1] = -100
    return h, w, b, y.to(device)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_expanded_labels(gen, device, backend, reduction):
    h, w, _, _ = _base(gen, device, n=6)
    strided = torch.randint(0, w.shape[0], (12,), generator=gen).to(device)[::2]
    expanded = torch.tensor(3, device=device).expand(6)
    for labels in (strided, expanded):
        assert not labels.is_contiguous()
        _check([h, w], lambda h, w: (h, w, None), labels, backend, gen, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_hidden_and_weight(gen, device, backend, reduction):
    """A hidden of shape (N, H) that is a transposed (H, N) tensor (dense, not contiguous), and a
    weight stored as (H, V): the precomputed-gradient path must accept both."""
    h, w, _, y = _base(gen, device)
    leaves = [h.t().contiguous(), w.t().contiguous()]
    _check(leaves, lambda ht, wt: (ht.t(), wt.t(), None), y, backend, gen, reduction=reduction)


@pytest.mark.parametrize("bias_kind", ["strided", "expanded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_expanded_bias(gen, device, backend, bias_kind):
    """V = 32 keeps fp32 rows 16-byte aligned, so the Triton backend takes its fused logits GEMM
    (under the interpreter too), which reads the bias by column."""
    h, w, _, y = _base(gen, device)
    V = w.shape[0]
    b2 = torch.randn(2 * V, generator=gen).to(device)

    def views(h, w, b2):
        return h, w, b2[::2] if bias_kind == "strided" else b2[:1].expand(V)

    _check([h, w, b2], views, y, backend, gen, label_smoothing=0.1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_and_strided_hidden_and_weight(gen, device, backend):
    """Rows that share storage (an expanded hidden row, an expanded weight row) and rows with a
    stride wider than H."""
    h, w, _, y = _base(gen, device)
    N, H = h.shape
    wide_w = torch.randn(w.shape[0], 2 * H, generator=gen).to(device)
    _check([h[:1], wide_w], lambda r, ww: (r.expand(N, -1), ww[:, ::2], None), y, backend, gen)
    wide_h = torch.randn(N, H + 8, generator=gen).to(device)
    _check([wide_h, w[:1]], lambda wh, r: (wh[:, 4:-4], r.expand(w.shape[0], -1), None), y, backend, gen)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_and_weight_aliasing_one_storage(gen, device, backend):
    """hidden rows that are the weight's own rows: both gradients land on the one tensor, and
    the input is left unmodified."""
    _, w, _, _ = _base(gen, device)
    labels = torch.randint(0, w.shape[0], (10,), generator=gen).to(device)
    (shared,) = _check([w], lambda s: (s[5:15], s, None), labels, backend, gen)
    assert torch.equal(shared.detach(), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_sequences_shifted_like_a_causal_lm(gen, device, backend):
    """``F.pad(labels, (0, 1))[..., 1:]`` at sequence length 1 is a strided view of ignored
    tokens only (a patched model fed 1-token sequences): the loss is exactly 0."""
    h, w, _, _ = _base(gen, device, n=4)
    labels = torch.randint(0, w.shape[0], (4, 1), generator=gen).to(device)
    targets = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    assert not targets.is_contiguous()
    hl = h.reshape(4, 1, -1).requires_grad_()
    loss = call_raw(hl, w, targets, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(hl.grad, torch.zeros_like(hl))
