"""From per-token loss terms to the loss a call returns: the z-loss rows, the divisor of
reduction "mean", the reduction itself and each row's weight in it (the per-row coefficient
its gradients are scaled by). Shared by ``operator`` and the vocabulary-parallel loss."""

from __future__ import annotations

import torch
from torch import Tensor

from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ClassWeight

_F32 = torch.float32


def counted_divisor(
    opts: LossOptions,
    class_weight: ClassWeight | None,
    num_items: Tensor | None,
    num_items_value: float | None,
) -> bool:
    """Whether the divisor of "mean" is the number of kept tokens (no ``num_items_in_batch``, no
    class weights): then ``loss_divisor`` can take that number as read on the host."""
    return opts.reduction == "mean" and num_items is None and num_items_value is None and class_weight is None


def loss_divisor(
    opts: LossOptions,
    keep: Tensor,
    labels: Tensor,
    class_weight: ClassWeight | None,
    num_items: Tensor | None,
    num_items_value: float | None,
    n_kept: int | None = None,
) -> Tensor | float:
    """What the summed loss is divided by: ``num_items_in_batch``, else the number of kept tokens
    (F.cross_entropy's sum of their class weights). A zero divisor can only be right when nothing
    counts (the sum is then 0), so it is replaced by 1: the loss is exactly 0, never NaN. Class
    weights summing to 0 over the kept labels say that no token counts, though z-loss and label
    smoothing terms would still sum to more than 0: that divisor becomes inf, so every row
    weighs exactly 0 (``F.cross_entropy`` gives NaN there). ``n_kept``: the number of kept
    tokens when the host already knows it (``counted_divisor``), which then is the divisor, a
    Python number (rounded to fp32 where it divides, as the count's fp32 tensor would be)."""
    if opts.reduction != "mean":
        return 1.0
    if num_items is not None:
        den = num_items.to(device=keep.device, dtype=_F32).reshape(())
    elif num_items_value is not None:
        return num_items_value or 1.0
    elif n_kept is not None and class_weight is None:
        return float(n_kept or 1)
    elif class_weight is not None:
        valid = keep & (labels >= 0) & (labels < class_weight.weight.shape[0])  # checked after this
        den = torch.where(valid, class_weight.weight[torch.where(valid, labels, 0)], 0.0).sum()
        return torch.where(den == 0, torch.full_like(den, float("inf")), den)
    else:
        den = keep.sum().float()
    return torch.where(den == 0, torch.ones_like(den), den)


def row_weights(keep: Tensor, reduction: str, divisor: Tensor | float) -> Tensor:
    """Each row's weight in the reduced loss: 1 for a kept row (over ``divisor`` for "mean"),
    0 for an ignored one."""
    return keep.float() / divisor if reduction == "mean" else keep.float()


def reduce_rows(rows: Tensor, reduction: str, divisor: Tensor | float) -> Tensor:
    """``rows`` as the reduction asks: as they are ("none"), their sum, or the sum over ``divisor``."""
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / divisor


def z_loss_rows(lse: Tensor, opts: LossOptions, token_scale: Tensor | None = None) -> Tensor:
    """``z_loss_scale * lse^2`` per row, times the row's ``token_scale`` when token scaling gives
    one (as the row kernels scale the cross-entropy); exactly 0 without z-loss (``0 * lse^2``
    would be NaN once lse^2 overflows fp32, at |lse| > 1.8e19, where the cross-entropy itself is
    finite)."""
    if opts.z_loss_scale == 0.0:
        return torch.zeros_like(lse)
    z_rows = opts.z_loss_scale * lse.square()
    return z_rows if token_scale is None else z_rows * token_scale
