"""The forward's one host sync: the label range check, which also reads how many labels are kept
and, when enough are ignored, the index of the kept rows that the token pass then walks alone."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from liger_patch.ops.core import validation
from liger_patch.ops.core.tuning import Tuning


class CheckedLabels(NamedTuple):
    labels: Tensor
    poison: Tensor | None
    kept_rows: Tensor | None
    n_kept: int | None  # read in the sync; None while a CUDA graph is captured


def _capturing(labels: Tensor) -> bool:
    return labels.is_cuda and torch.cuda.is_current_stream_capturing()


def start_label_check(
    labels: Tensor, vocab: int, ignore_index: int, user_divisor: Tensor | None
) -> validation.ValueCheck | None:
    """``checked_labels``' device work, enqueued without waiting for its values
    (``validation.start_value_check``); ``None`` while a CUDA graph is captured (no sync there).
    Work the caller enqueues before passing it to ``checked_labels`` runs while the host waits."""
    if _capturing(labels):
        return None
    return validation.start_value_check(labels, vocab, ignore_index, user_divisor)


def checked_labels(
    labels: Tensor,
    vocab: int,
    ignore_index: int,
    user_divisor: Tensor | None,
    tuning: Tuning,
    started: validation.ValueCheck | None = None,
) -> CheckedLabels:
    """The label range (and ``num_items_in_batch`` tensor) check: raises as ``validation.check_values``
    does, in one host sync, which also reads the number of kept labels: with at least
    ``Tuning.skip_ignored_share`` of them ignored, ``kept_rows`` is the kept rows' index
    (``run_chunks``'s ``row_index``), else ``None``; ``n_kept`` is their number.

    While a CUDA graph is captured no sync is allowed: out-of-range labels are then turned into
    ``ignore_index`` (kernels never index with them), every row is computed, and the second result
    is a 0-d factor, NaN when anything was bad and 1 otherwise, that the caller multiplies every
    result by. ``user_divisor`` is the ``num_items_in_batch`` tensor's divisor to check, or ``None``.
    ``started``: this check as ``start_label_check`` began it."""
    if not _capturing(labels):
        if started is None:
            started = validation.start_value_check(labels, vocab, ignore_index, user_divisor)
        n_kept = started.result()
        if not tuning.skips_ignored(labels.shape[0], n_kept):
            return CheckedLabels(labels, None, None, n_kept)
        kept = torch.nonzero_static(labels != ignore_index, size=n_kept).view(-1)
        return CheckedLabels(labels, None, kept, n_kept)
    bad_rows = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    bad = bad_rows.any()
    if user_divisor is not None:
        bad = bad | ~(torch.isfinite(user_divisor) & (user_divisor >= 0))
    nan, one = (torch.full((), v, device=labels.device) for v in (float("nan"), 1.0))
    sanitized = torch.where(bad_rows, ignore_index, labels)
    return CheckedLabels(sanitized, torch.where(bad, nan, one), None, None)
