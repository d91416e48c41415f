"""A forward's one host sync: the label range check, which also reads how many labels are kept
and, when enough are ignored (``Tuning.skip_ignored_share``), the index of the kept rows that the
token pass then walks alone; and the rows' weights in the reduced loss that follow from it.

In two steps, so that the GPU has work while the host waits: ``begin_label_check`` queues the
check's device work and the copy of its values to the host; the caller queues the start of its
first chunk (``head_start``); ``finish_label_check`` waits for the values. Both losses' forwards
run it. While a CUDA graph is captured no sync is allowed: out-of-range labels are then turned
into ``ignore_index`` (kernels never index with them), every row is walked, and the loss and every
gradient are multiplied by a 0-d ``poison`` factor, NaN when anything was bad and 1 otherwise
(docs/loss.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from liger_patch.ops.core import validation
from liger_patch.ops.core.reduction import counted_divisor, loss_divisor, row_weights
from liger_patch.ops.core.tuning import Tuning


def capturing(labels: Tensor) -> bool:
    """Whether the current CUDA stream is capturing a graph (no host sync allowed)."""
    return labels.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass(frozen=True)
class NumItems:
    """``num_items_in_batch`` as the registered operators take it: a tensor or a float (the
    other ``None``; both ``None`` when none was given)."""

    tensor: Tensor | None = None
    value: float | None = None


@dataclass(frozen=True)
class PendingLabels:
    """A label check begun: the labels (N,) int64, ``keep`` (N,) bool, the reduction's inputs, the
    divisor of "mean" (``None`` when it is the kept count, read in the sync) and the check's
    device work (``None`` while a CUDA graph is captured)."""

    labels: Tensor
    keep: Tensor
    vocab: int
    ignore_index: int
    reduction: str
    class_weights: Tensor | None
    num_items: NumItems
    divisor: Tensor | float | None
    started: validation.ValueCheck | None

    @property
    def user_divisor(self) -> Tensor | None:
        """The ``num_items_in_batch`` tensor's divisor, whose value the check checks."""
        return self.divisor if self.num_items.tensor is not None else None


@dataclass(frozen=True)
class CheckedLabels:
    """A label check's answer: the labels (sanitized while a graph is captured) and ``keep``, the
    kept rows' index when the pass walks only those (``kept_rows``, else ``None``), their number
    (``n_kept``, ``None`` while captured), the 0-d ``poison`` factor (captured only), the
    divisor of "mean" and each row's weight in the reduced loss (poison included)."""

    labels: Tensor
    keep: Tensor
    kept_rows: Tensor | None
    n_kept: int | None
    poison: Tensor | None
    divisor: Tensor | float
    row_weight: Tensor


def begin_label_check(
    labels: Tensor,
    vocab: int,
    ignore_index: int,
    reduction: str,
    class_weights: Tensor | None,
    num_items: NumItems,
) -> PendingLabels:
    """Queue the check of ``labels`` (N,) against ``vocab`` (and of a ``num_items`` tensor), with
    the divisor of "mean" unless it is the kept count (no launches for it: read in the sync)."""
    labels = labels.long().contiguous()  # kernels index labels by row
    keep = labels != ignore_index
    divisor = None
    if not counted_divisor(reduction, class_weights, num_items.tensor, num_items.value):
        divisor = loss_divisor(reduction, keep, labels, class_weights, num_items.tensor, num_items.value)
    user_divisor = divisor if num_items.tensor is not None else None
    started = None
    if not capturing(labels):
        started = validation.start_value_check(labels, vocab, ignore_index, user_divisor)
    return PendingLabels(
        labels, keep, vocab, ignore_index, reduction, class_weights, num_items, divisor, started
    )


def finish_label_check(pending: PendingLabels, tuning: Tuning) -> CheckedLabels:
    """Wait for the check (raising as ``validation.check_values`` does, in one host sync, which
    also reads the number of kept labels) and give the rows to walk: with at least
    ``tuning.skip_ignored_share`` of the labels ignored, the kept rows' index. While a CUDA graph
    is captured: no sync, every row, and the poison factor (see the module doc)."""
    labels, keep, poison, kept_rows, n_kept = pending.labels, pending.keep, None, None, None
    if pending.started is not None:
        n_kept = pending.started.result()
        if tuning.skips_ignored(labels.shape[0], n_kept):
            kept_rows = torch.nonzero_static(keep, size=n_kept).view(-1)
    else:
        labels, poison = _sanitized(pending)
        keep = labels != pending.ignore_index
    divisor = pending.divisor
    if divisor is None:
        divisor = loss_divisor(pending.reduction, keep, labels, pending.class_weights, None, None, n_kept)
    row_weight = row_weights(keep, pending.reduction, divisor)
    if poison is not None:
        row_weight = row_weight * poison
    return CheckedLabels(labels, keep, kept_rows, n_kept, poison, divisor, row_weight)


def _sanitized(pending: PendingLabels) -> tuple[Tensor, Tensor]:
    """The labels with every out-of-range one made ``ignore_index``, and the poison factor: NaN
    when a label or the ``num_items_in_batch`` tensor was bad, else 1 (no sync)."""
    labels, ignore_index = pending.labels, pending.ignore_index
    bad_rows = _out_of_range(labels, pending.vocab, ignore_index)
    bad = bad_rows.any()
    user_divisor = pending.user_divisor
    if user_divisor is not None:
        bad = bad | ~(torch.isfinite(user_divisor) & (user_divisor >= 0))
    nan, one = (torch.full((), v, device=labels.device) for v in (float("nan"), 1.0))
    return torch.where(bad_rows, ignore_index, labels), torch.where(bad, nan, one)


def _out_of_range(labels: Tensor, vocab: int, ignore_index: int) -> Tensor:
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab))


def in_range_while_captured(labels: Tensor, vocab: int, ignore_index: int) -> Tensor:
    """``labels`` for a recomputing backward: while a CUDA graph is captured, with every
    out-of-range label made ``ignore_index`` as the forward did (its coefficients carry the
    poison), so no kernel indexes with one; otherwise as they are (the forward checked them)."""
    if not capturing(labels):
        return labels
    return torch.where(_out_of_range(labels, vocab, ignore_index), ignore_index, labels)


def kept_index(labels: Tensor, ignore_index: int) -> Tensor | None:
    """The kept rows' index for a pass that walks only them, read with a host sync (``nonzero``);
    ``None`` (every row) when every row is kept, and while a CUDA graph is captured (no sync)."""
    if capturing(labels):
        return None
    kept = torch.nonzero(labels != ignore_index).view(-1)
    return None if kept.shape[0] == labels.shape[0] else kept
