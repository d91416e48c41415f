"""The Triton kernel that scales the forward's precomputed gradients by the upstream gradient:
the fp32 product rounded once to the tensor's dtype, and no change at all (not one bit) when the
scale is 1."""

import pytest
import torch

from liger_patch.ops.core.triton.scale import scale_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_scale_is_the_fp32_product_rounded_once(gen, device, dtype, numel):
    x = (torch.randn(numel, generator=gen) * 3).to(dtype).to(device)
    y = (torch.randn(7, 5, generator=gen)).to(dtype).to(device)
    scale = torch.tensor(0.3721, device=device)
    ex, ey = (x.float() * scale).to(dtype), (y.float() * scale).to(dtype)
    scale_([x, y], scale)
    # Bit for bit, under the interpreter too (it truncates to bf16 unless the kernel rounds first).
    assert torch.equal(x, ex) and torch.equal(y, ey)


def test_scale_one_is_untouched(gen, device):
    x = torch.randn(100, generator=gen).bfloat16().to(device)
    x[3] = float("nan")
    before = x.view(torch.int16).clone()
    scale_([x], torch.ones((), device=device))
    assert torch.equal(x.view(torch.int16), before)


def test_scale_zero_and_empty(gen, device):
    x = torch.randn(10, generator=gen).to(device)
    scale_([x, torch.empty(0, device=device)], torch.zeros((), device=device))
    assert torch.equal(x, torch.zeros_like(x))


def test_scale_needs_contiguous(gen, device):
    x = torch.randn(4, 6, generator=gen).to(device).t()
    with pytest.raises(ValueError, match="contiguous"):
        scale_([x], torch.ones((), device=device))


@pytest.mark.parametrize("sizes", [(65, 1), (1, 130, 7), (64, 64, 64, 3)], ids=str)
def test_tensors_of_mixed_dtypes_scaled_two_per_launch(gen, device, sizes):
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    tensors = [torch.randn(n, generator=gen).to(dtypes[i]).to(device) for i, n in enumerate(sizes)]
    scale = torch.tensor(-1.7311, device=device)
    expected = [(t.float() * scale).to(t.dtype) for t in tensors]
    scale_(tensors, scale)
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(got, want)
