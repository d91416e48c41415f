"""A forward's label bookkeeping in one launch: the range check, the divisor of "mean", the poison
factor, the sanitized labels and every row's weight in the reduced loss.

Done with PyTorch ops (``kept_rows``' torch path) this is about 25 small launches, each costing the
host more than its GPU time: at a few hundred tokens the host, not the GPU, bounds a call
(docs/perf-notes.md item 53). One program walks the labels twice: first the kept count, the kept
labels' least and greatest value, whether any is out of range, and the divisor (the kept count,
or the ``num_items_in_batch`` tensor's value, 0 read as 1); then it writes each row's label (an
out-of-range one made ``ignore_index``, as the kernels must never index with it) and weight,
``keep / divisor`` (an IEEE division, as PyTorch's) times the poison factor, NaN when a label or
the divisor was bad and 1 otherwise. The values are those of the torch path, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.reduction import mean_divisor
from liger_patch.ops.core.triton.common import jitted

_BLOCK = 4096  # the kernel's DIVISOR is ``reduction.DivisorKind``


class LabelCheck(NamedTuple):
    """What ``label_check`` leaves on the device: ``labels`` (N,) int64 with out-of-range ones made
    ``ignore_index``; ``row_weight`` (N,) fp32, poison included; ``stats`` (4,) int64: the kept
    count, the least and greatest kept label (0 counted in), 1 when the divisor is bad; the 0-d
    fp32 ``divisor`` of "mean" and ``poison`` (NaN or 1)."""

    labels: torch.Tensor
    row_weight: torch.Tensor
    stats: torch.Tensor
    divisor: torch.Tensor
    poison: torch.Tensor


def _label_check_kernel(
    labels_ptr,
    safe_ptr,
    weight_ptr,
    stats_ptr,
    scalars_ptr,
    items_ptr,
    n,
    vocab,
    ignore_index,
    fixed_divisor,
    DIVISOR: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK)
    count = tl.zeros([], dtype=tl.int64)
    low = tl.zeros([], dtype=tl.int64)
    high = tl.zeros([], dtype=tl.int64)
    bad = tl.zeros([], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        idx = start + offsets
        y = tl.load(labels_ptr + idx, mask=idx < n, other=ignore_index)
        keep = y != ignore_index
        out = keep & ((y < 0) | (y >= vocab))
        count += tl.sum((keep & ~out).to(tl.int64), axis=0)
        kept_y = tl.where(keep, y, 0)
        low = tl.minimum(low, tl.min(kept_y, axis=0))
        high = tl.maximum(high, tl.max(kept_y, axis=0))
        bad = tl.maximum(bad, tl.max(out.to(tl.int32), axis=0))
    divisor = tl.zeros([], dtype=tl.float32) + fixed_divisor
    bad_divisor = tl.zeros([], dtype=tl.int32)
    if DIVISOR == 1:  # COUNT
        divisor = tl.where(count == 0, 1.0, count.to(tl.float32))
    if DIVISOR == 2:  # TENSOR
        divisor = tl.load(items_ptr).to(tl.float32)
        divisor = tl.where(divisor == 0.0, 1.0, divisor)
        bad_divisor = (~((divisor >= 0.0) & (divisor < float("inf")))).to(tl.int32)  # NaN fails both
    poison = tl.where((bad | bad_divisor) != 0, float("nan"), 1.0)
    tl.store(stats_ptr, count)
    tl.store(stats_ptr + 1, low)
    tl.store(stats_ptr + 2, high)
    tl.store(stats_ptr + 3, bad_divisor.to(tl.int64))
    tl.store(scalars_ptr, divisor)
    tl.store(scalars_ptr + 1, poison)
    for start in range(0, n, BLOCK):
        idx = start + offsets
        mask = idx < n
        y = tl.load(labels_ptr + idx, mask=mask, other=ignore_index)
        keep = y != ignore_index
        out = keep & ((y < 0) | (y >= vocab))
        tl.store(safe_ptr + idx, tl.where(out, ignore_index, y), mask=mask)
        kept = (keep & ~out).to(tl.float32)
        weight = kept if DIVISOR == 0 else tl.math.div_rn(kept, divisor)
        tl.store(weight_ptr + idx, weight * poison, mask=mask)


def label_check(
    labels: torch.Tensor,
    vocab: int,
    ignore_index: int,
    reduction: str,
    num_items: torch.Tensor | None = None,
    num_items_value: float | None = None,
) -> LabelCheck:
    """The label bookkeeping of a forward over ``labels`` (N,) int64, contiguous: reduction "mean"
    divides by ``num_items`` (a 1-element tensor) or ``num_items_value`` when given (0 read as 1),
    else by the kept count; "sum" and "none" weigh kept rows 1. One launch."""
    divisor = mean_divisor(reduction, num_items, num_items_value)
    n, device = labels.shape[0], labels.device
    safe = torch.empty_like(labels)
    row_weight = torch.empty(n, dtype=torch.float32, device=device)
    stats = torch.empty(4, dtype=torch.int64, device=device)
    scalars = torch.empty(2, dtype=torch.float32, device=device)
    items = scalars  # not read unless num_items is given
    if num_items is not None:  # a CPU tensor too: its pageable copy is staged at once, no wait
        items = num_items.reshape(1).to(device, non_blocking=True)
    interpret = env.triton_interpret()
    jitted(_label_check_kernel, interpret)[(1,)](
        labels,
        safe,
        row_weight,
        stats,
        scalars,
        items,
        n,
        vocab,
        ignore_index,
        divisor.fixed,
        DIVISOR=int(divisor.kind),
        BLOCK=256 if interpret else _BLOCK,
        num_warps=8,
    )
    return LabelCheck(safe, row_weight, stats, scalars[0], scalars[1])
