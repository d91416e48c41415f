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
import triton
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.triton.common import jitted, round_bf16_nearest

_BLOCK = 4096


def _scale_kernel(
    x_ptr, scale_ptr, n, BLOCK: tl.constexpr, ROUND_BF16_NEAREST: tl.constexpr, ROUND_FN: tl.constexpr
):
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32) * scale
        if ROUND_BF16_NEAREST:  # the interpreter truncates to bf16; the GPU rounds to nearest
            x = ROUND_FN(x)
        tl.store(x_ptr + offsets, x.to(x_ptr.dtype.element_ty), mask=mask)


def scale_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply each contiguous tensor in place by the 0-d ``scale`` (skipped on device when 1)."""
    interpret = env.triton_interpret()
    scale = scale.reshape(1)
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("scale_ needs contiguous tensors")
        n = t.numel()
        if n == 0:
            continue
        block = 64 if interpret else _BLOCK
        round_nearest = interpret and t.dtype == torch.bfloat16
        jitted(_scale_kernel)[(triton.cdiv(n, block),)](
            t,
            scale,
            n,
            BLOCK=block,
            ROUND_BF16_NEAREST=round_nearest,
            # A jitted function as a constexpr costs host time at every launch: passed only when used.
            ROUND_FN=jitted(round_bf16_nearest) if round_nearest else None,
            num_warps=8,
        )
