"""The fp64 reference itself, checked against torch.nn.functional where torch has the option.

No liger_patch code runs here: if these fail, the reference is wrong, not the op.
"""

import pytest
import torch
import torch.nn.functional as F

from liger_patch.ops.reference import reference_flce


def _inputs(gen, N=13, H=7, V=11, bias=True):
    h = torch.randn(N, H, generator=gen, dtype=torch.float64)
    w = torch.randn(V, H, generator=gen, dtype=torch.float64)
    b = torch.randn(V, generator=gen, dtype=torch.float64) if bias else None
    y = torch.randint(0, V, (N,), generator=gen)
    y[[0, 4, 5, N - 1]] = -100
    return h, w, b, y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3, 1.0])
def test_reference_matches_torch_cross_entropy(gen, reduction, label_smoothing):
    h, w, b, y = _inputs(gen)
    loss, z = reference_flce(h, w, y, b, reduction=reduction, label_smoothing=label_smoothing)
    expected = F.cross_entropy(F.linear(h, w, b), y, reduction=reduction, label_smoothing=label_smoothing)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(z, torch.zeros_like(z))


def test_reference_options_by_hand(gen):
    h, w, b, y = _inputs(gen)
    s, c, e, k = 1.3, 2.5, 0.2, 0.01
    x = c * torch.tanh(s * F.linear(h, w, b) / c)
    lse = torch.logsumexp(x, -1)
    keep = y != -100
    logp = x.log_softmax(-1)
    nll = -logp[keep].gather(1, y[keep, None]).squeeze(1)
    smooth = -logp[keep].mean(-1)
    per = (1 - e) * nll + e * smooth + k * lse[keep] ** 2
    loss, z = reference_flce(
        h, w, y, b, label_smoothing=e, z_loss_scale=k, softcap=c, logit_scale=s, num_items_in_batch=29
    )
    torch.testing.assert_close(loss, per.sum() / 29, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, k * (lse[keep] ** 2).sum() / 29, rtol=1e-12, atol=1e-12)


def test_reference_nothing_kept_is_zero_and_attached(gen):
    h, w, b, y = _inputs(gen)
    h.requires_grad_()
    loss, _ = reference_flce(h, w, torch.full_like(y, -100), b, num_items_in_batch=0)
    assert loss.item() == 0.0 and loss.requires_grad
    (g,) = torch.autograd.grad(loss, h)
    assert torch.equal(g, torch.zeros_like(h))
