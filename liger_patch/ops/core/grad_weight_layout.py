"""grad_W's bytes: where the token chunks sum it, what else borrows them, and how the sum becomes
grad_W.

The token chunks sum grad_W in fp32, in the hidden states' dtype or in the weight's own
(``ChunkPlan.grad_weight_fp32``). A weight wider than the GEMMs (fp32 under bf16 autocast) is
rounded to their dtype, and when the plan says so (``ChunkPlan.weight_in_grad_weight``) that copy
lives in grad_W's second half and the sum in its first, widened in place after the last chunk:
the op then needs no memory for either. Chunk buffers (the two-pass path's logits) are laid over
grad_W's bytes not yet written the same way (``buffer_in``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from liger_patch.ops.core.budget import ALIGN, ChunkPlan
from liger_patch.ops.core.contexts import autocast_off
from liger_patch.ops.core.gemm import has_out_dtype_mm, mm_into


def buffer_in(
    storage: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, at_end: bool = False
) -> torch.Tensor:
    """A contiguous ``rows x cols`` tensor of ``dtype`` laid over the bytes of ``storage`` (a
    fresh contiguous tensor): its first bytes, or with ``at_end`` its last ones, starting at a
    16-byte boundary (so up to 15 bytes before the last ``rows * cols`` elements)."""
    flat = storage.view(-1).view(torch.uint8)
    nbytes = rows * cols * dtype.itemsize
    start = (flat.numel() - nbytes) // ALIGN * ALIGN if at_end else 0
    return flat[start : start + nbytes].view(dtype).view(rows, cols)


def accumulate_grad_weight(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """``acc (+)= g^T h``; ``first`` overwrites instead of adding (no zero-fill needed)."""
    if first:
        mm_into(acc, g.t(), h)
    elif g.dtype == acc.dtype:
        acc.addmm_(g.t(), h)
    elif acc.dtype == torch.float32 and has_out_dtype_mm(g.device.type):
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(g.t() @ h)


def grad_weight_sum_dtype(plan: ChunkPlan, operand_dtype: torch.dtype) -> torch.dtype:
    """The dtype the token chunks sum grad_W in: fp32 where the plan says, else the operands'."""
    return torch.float32 if plan.grad_weight_fp32 else operand_dtype


class WeightSpec(NamedTuple):
    """What a grad_W made later takes from the weight: its shape, dtype and device."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def grad_weight_buffers(
    plan: ChunkPlan, weight: torch.Tensor, operand_dtype: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """grad_W in the weight's dtype, and the token chunks' sum when it is kept in another dtype
    (fp32, or the hidden states' dtype under autocast): a view of grad_W's first half when the
    plan puts the weight's copy in the second (``plan.weight_in_grad_weight``), else its own
    tensor, and grad_W (``None`` here) is made from it at the end. A sum whose first chunk
    overwrites, and pass B, which writes every block, need no zeros."""
    fills = torch.empty if plan.two_pass or plan.overwrite_first else torch.zeros
    if plan.two_pass:
        return fills(weight.shape, dtype=weight.dtype, device=weight.device), None
    sum_dtype = grad_weight_sum_dtype(plan, operand_dtype)
    if sum_dtype == weight.dtype:
        return fills(weight.shape, dtype=weight.dtype, device=weight.device), None
    if not plan.weight_in_grad_weight:  # grad_W is made from the sum at the end
        return None, fills(weight.shape, dtype=sum_dtype, device=weight.device)
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    grad_sum = buffer_in(grad_weight, *weight.shape, sum_dtype)
    if fills is torch.zeros:
        grad_sum.zero_()
    return grad_weight, grad_sum


def weight_operand(
    weight: torch.Tensor,
    operand_dtype: torch.dtype,
    gemm_dtype: torch.dtype,
    grad_weight: torch.Tensor | None,
) -> torch.Tensor:
    """The weight as the GEMMs read it: rounded to the hidden states' dtype, as autocast rounds
    both operands of an ``nn.Linear`` (a no-op when the dtypes match), in the GEMMs' dtype. With
    ``grad_weight``, the copy is laid over its second half (``ChunkPlan.weight_in_grad_weight``)."""
    rounded = weight if gemm_dtype == operand_dtype else weight.to(operand_dtype)
    if grad_weight is None:
        return rounded.to(gemm_dtype)
    return buffer_in(grad_weight, *weight.shape, gemm_dtype, at_end=True).copy_(rounded)


def widen_in_place(buffer: torch.Tensor, narrow: torch.dtype) -> None:
    """Turn ``buffer``, whose first half holds its ``numel()`` values in ``narrow`` (half its
    element width), into those values in its own dtype.

    Back to front, halving: the block ``[a, b)`` with ``a = ceil(b / 2)`` moves from bytes
    ``[a, b)`` to ``[2a, 2b)`` (in units of the narrow width), which overlaps neither its own
    source (``b <= 2a``) nor the values before it, still unread. About log2(n) copies and no
    temporary but the first value's."""
    n = buffer.numel()
    wide = buffer.view(-1)
    src = wide.view(narrow)[:n]
    stop = n
    while stop > 1:
        start = (stop + 1) // 2
        wide[start:stop].copy_(src[start:stop])
        stop = start
    if stop == 1:
        wide[:1].copy_(src[:1].clone())


@dataclass(frozen=True)
class GradWeightLater:
    """grad_W of a forward of one token chunk of every row, left to be made later from the
    chunk's gradient ``g`` and hidden rows ``h`` as its GEMM reads them, as that chunk would
    make it: a new sum of ``sum_dtype`` (written by the GEMM where ``overwrite``, else added to
    zeros: ``accumulate_grad_weight``), rounded to the weight's dtype: the same launches on the
    same values, so the same bits. Holds the weight's ``WeightSpec``, not the weight (a CUDA
    graph keeps this and must not keep the weight alive: ``core/graphed_forward.Later``)."""

    g: torch.Tensor
    h: torch.Tensor
    sum_dtype: torch.dtype
    overwrite: bool
    weight: WeightSpec

    def __call__(self) -> torch.Tensor:
        fills = torch.empty if self.overwrite else torch.zeros
        acc = fills(self.weight.shape, dtype=self.sum_dtype, device=self.weight.device)
        with autocast_off(self.h.device.type):
            accumulate_grad_weight(acc, self.g, self.h, self.overwrite)
        return acc.to(self.weight.dtype)
