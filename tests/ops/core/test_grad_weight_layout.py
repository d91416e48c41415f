"""``grad_weight_layout``: buffers laid over grad_W's bytes, the token chunks' sum beside the
weight's copy in one grad_W, and the in-place widening of that sum. run_chunks end to end with
this layout: test_chunked.py."""

import pytest
import torch

from liger_patch.ops.core.budget import ALIGN, ChunkPlan
from liger_patch.ops.core.grad_weight_layout import (
    buffer_in,
    grad_weight_buffers,
    weight_operand,
    widen_in_place,
)


def _byte_span(t: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    """``[start, stop)`` of ``t``'s bytes, counted from ``base``'s first byte."""
    start = t.data_ptr() - base.data_ptr()
    return start, start + t.numel() * t.element_size()


@pytest.mark.parametrize(
    ("rows", "cols", "dtype"), [(3, 5, torch.float32), (2, 7, torch.bfloat16), (4, 4, torch.float64)]
)
def test_buffer_at_the_end_starts_aligned_within_the_last_bytes(rows, cols, dtype):
    storage = torch.empty(101, dtype=torch.float32)  # 404 bytes: no size above ends on a boundary
    buffer = buffer_in(storage, rows, cols, dtype, at_end=True)
    start, stop = _byte_span(buffer, storage)
    assert buffer.shape == (rows, cols) and buffer.dtype == dtype and buffer.is_contiguous()
    assert start % ALIGN == 0 and stop <= storage.nbytes < stop + ALIGN
    assert _byte_span(buffer_in(storage, rows, cols, dtype), storage)[0] == 0


@pytest.mark.parametrize("overwrite_first", [False, True])
def test_sum_and_weight_copy_share_grad_weight_without_overlap(gen, overwrite_first):
    """fp64 weight, fp32 GEMMs (as an fp32 weight under bf16 autocast): grad_W's first half holds
    the fp32 sum (zeros unless the first chunk overwrites), its second half the rounded copy."""
    weight = torch.randn(37, 8, generator=gen, dtype=torch.float64)
    plan = ChunkPlan(rows=5, weight_in_grad_weight=True, overwrite_first=overwrite_first)
    grad_weight, grad_sum = grad_weight_buffers(plan, weight, torch.float32)
    copy = weight_operand(weight, torch.float32, torch.float32, grad_weight)
    assert grad_weight.dtype == torch.float64 and grad_sum.dtype == torch.float32
    sum_start, sum_stop = _byte_span(grad_sum, grad_weight)
    copy_start, copy_stop = _byte_span(copy, grad_weight)
    assert sum_start == 0 and sum_stop <= copy_start and copy_stop <= grad_weight.nbytes
    assert torch.equal(copy, weight.float())
    if not overwrite_first:
        assert (grad_sum == 0).all()


@pytest.mark.parametrize(
    "narrow, wide", [(torch.float32, torch.float64), (torch.bfloat16, torch.float32)], ids=str
)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 100, 4097, 1 << 20])
def test_widen_in_place(gen, n, narrow, wide):
    """Every value lands in place, for sizes that halve evenly and unevenly."""
    values = torch.randn(n, generator=gen).to(narrow)
    buffer = torch.full((n,), float("nan"), dtype=wide)
    buffer.view(narrow)[:n] = values
    widen_in_place(buffer, narrow)
    assert torch.equal(buffer, values.to(wide))
