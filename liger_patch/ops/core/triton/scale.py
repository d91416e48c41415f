"""In-place scaling of the precomputed gradients by the upstream gradient, read on the device.

The forward computes the gradients at scale 1; the backward multiplies them by d(out)/d(loss),
a 0-d tensor on the device. ``loss.backward()`` makes that scalar exactly 1, so the kernel checks
it on the device and returns without touching memory: no host sync, and no pass over a grad_W
of a GB or more. Other scales cost one read and one write at memory bandwidth (torch's ``mul_``
by a 0-d fp32 tensor on a bf16 tensor ran at ~1 TB/s: 2.2 ms on a 1 GB grad_W, see
docs/perf-notes.md). The product is taken in fp32 and rounded once, as ``mul_`` does.
"""

from __future__ import annotations

import torch
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.triton.common import ceil_div, jitted, round_bf16_nearest

_BLOCK = 4096


def _scale_kernel(
    x_ptr,
    y_ptr,
    scale_ptr,
    n_x,
    n_y,
    BLOCK: tl.constexpr,
    ROUND_X: tl.constexpr,
    ROUND_Y: tl.constexpr,
    ROUND_FN: tl.constexpr,
):
    """Scales x (its blocks first) and y (the programs after them) in one launch."""
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        x_blocks = tl.cdiv(n_x, BLOCK)
        pid = tl.program_id(0)
        # Two copies of one block's work: x and y may differ in dtype, so no pointer picks between them.
        if pid < x_blocks:
            offsets = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n_x
            x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32) * scale
            if ROUND_X:  # the interpreter truncates to bf16; the GPU rounds to nearest
                x = ROUND_FN(x)
            tl.store(x_ptr + offsets, x.to(x_ptr.dtype.element_ty), mask=mask)
        else:
            offsets = (pid - x_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n_y
            y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32) * scale
            if ROUND_Y:
                y = ROUND_FN(y)
            tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def scale_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply each contiguous tensor in place by the 0-d ``scale`` (skipped on device when 1),
    two tensors per launch (a call's grad_h and grad_W: launches are host time)."""
    interpret = env.triton_interpret()
    block = 64 if interpret else _BLOCK
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("scale_ needs contiguous tensors")
    tensors = [t for t in tensors if t.numel()]
    for x, y in zip(tensors[::2], [*tensors[1::2], None], strict=False):
        n_y = 0 if y is None else y.numel()
        rounds = [interpret and t is not None and t.dtype == torch.bfloat16 for t in (x, y)]
        jitted(_scale_kernel, interpret)[(ceil_div(x.numel(), block) + ceil_div(n_y, block),)](
            x,
            x if y is None else y,
            scale,
            x.numel(),
            n_y,
            BLOCK=block,
            ROUND_X=rounds[0],
            ROUND_Y=rounds[1],
            # A jitted function as a constexpr costs host time at every launch: passed only when used.
            ROUND_FN=jitted(round_bf16_nearest, interpret) if any(rounds) else None,
            num_warps=8,
        )
