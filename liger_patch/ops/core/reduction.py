"""From per-token loss terms to the loss a call returns: the divisor of reduction "mean", the
reduction itself and each row's weight in it (the per-row coefficient its gradients are scaled
by). Shared by both losses' operators and their vocabulary-parallel forms."""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch
from torch import Tensor

_F32 = torch.float32


class DivisorKind(IntEnum):
    """What the summed loss is divided by, class weights aside (the label-check kernel's
    ``DIVISOR``): nothing ("sum", "none"), the kept count, the ``num_items_in_batch`` tensor, or a
    number."""

    NONE = 0
    COUNT = 1
    TENSOR = 2
    FIXED = 3


class MeanDivisor(NamedTuple):
    """``kind`` and, where it is a number (``NONE``: 1, ``FIXED``: ``num_items_in_batch`` with 0
    read as 1), that number ``fixed`` (1 otherwise)."""

    kind: DivisorKind
    fixed: float = 1.0

    @property
    def on_device(self) -> bool:
        """Whether the divisor is a device value (the kept count, a tensor), not a number."""
        return self.kind in (DivisorKind.COUNT, DivisorKind.TENSOR)


def mean_divisor(reduction: str, num_items: Tensor | None, num_items_value: float | None) -> MeanDivisor:
    """The one home of what a reduction divides by, without class weights (``loss_divisor``
    adds those): every path that makes the divisor starts here."""
    if reduction != "mean":
        return MeanDivisor(DivisorKind.NONE)
    if num_items is not None:
        return MeanDivisor(DivisorKind.TENSOR)
    if num_items_value is not None:
        return MeanDivisor(DivisorKind.FIXED, num_items_value or 1.0)
    return MeanDivisor(DivisorKind.COUNT)


def counted_divisor(
    reduction: str,
    class_weights: Tensor | None,
    num_items: Tensor | None,
    num_items_value: float | None,
) -> bool:
    """Whether the divisor of "mean" is the number of kept tokens (no ``num_items_in_batch``, no
    class weights): then ``loss_divisor`` can take that number as read on the host."""
    return reduction == "mean" and num_items is None and num_items_value is None and class_weights is None


def loss_divisor(
    reduction: str,
    keep: Tensor,
    labels: Tensor,
    class_weights: Tensor | None,
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
    what = mean_divisor(reduction, num_items, num_items_value)
    if not what.on_device:
        return what.fixed
    if num_items is not None:
        den = num_items.to(device=keep.device, dtype=_F32).reshape(())
    elif n_kept is not None and class_weights is None:
        return float(n_kept or 1)
    elif class_weights is not None:
        valid = keep & (labels >= 0) & (labels < class_weights.shape[0])  # checked after this
        den = torch.where(valid, class_weights[torch.where(valid, labels, 0)], 0.0).sum()
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


def weighted_total(rows: Tensor, row_weight: Tensor) -> Tensor:
    """The loss of reduction "mean" or "sum" from ``rows`` that are 0 at ignored rows, in one
    launch: their dot product with the rows' weights in the reduced loss (``row_weights``, which
    carry the divisor of "mean" and, where a check was not read, the poison factor). Equal to
    ``reduce_rows`` (times the poison) up to fp32 rounding."""
    return torch.dot(rows, row_weight)
