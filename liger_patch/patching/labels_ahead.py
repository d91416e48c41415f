"""The causal-LM loss's label check, begun before the model's body runs.

A fused forward's loss waits for its label check where skipping the ignored rows pays for the
wait (``ops/core/kept_rows.py``). Queued by the loss, that check runs after the whole body's GPU
work, and the wait is the host's lead on the GPU. The labels are known when the patched forward
starts, so it shifts them as the stock causal-LM loss will (``causal_loss.causal_lm_loss``) and
begins their check then (``functional.check_labels_ahead``): the loss's call over those targets
takes it, answered long since in a host-bound step. The check, the decisions taken from it and
the results are the same; only when the check's device work runs changes.

Begun only for a call the stock causal-LM loss will take (the model's ``loss_function`` swapped,
``labels`` given and no ``shift_labels``), with the head's full vocabulary known (not a
tensor-parallel shard), ``Tuning.check_labels_ahead`` on, and not while compiled. The loss uses
the targets made here only for the very ``labels`` tensor the forward got and the default
``ignore_index``; a check no loss took is dropped when the forward ends, and that patch begins
none again (its model changes its labels, or takes another loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from liger_patch.ops.core import early_checks
from liger_patch.ops.cross_entropy.functional import check_labels_ahead
from liger_patch.patching.sharded_head import head_tensor, head_weight_is_managed
from liger_patch.patching.state import PatchState

__all__ = ["LabelsAhead", "begin_labels_ahead"]

STOCK_IGNORE_INDEX = -100  # transformers' ForCausalLMLoss's default


@dataclass
class LabelsAhead:
    """A forward's shifted ``targets`` (int64, contiguous, on the head's device) made from its
    ``labels`` and ``num_items_in_batch`` moved there, whose label check is queued (``key``)."""

    labels: torch.Tensor
    targets: torch.Tensor
    num_items: Any
    moved_num_items: Any
    key: tuple

    def targets_for(self, labels: Any, ignore_index: int) -> torch.Tensor | None:
        """The targets made here, for the loss over these very ``labels``; else ``None``."""
        return self.targets if labels is self.labels and ignore_index == STOCK_IGNORE_INDEX else None

    def num_items_for(self, num_items: Any, device: torch.device) -> Any:
        """``num_items`` on ``device``: the tensor moved here where it is the forward's own."""
        if num_items is self.num_items and self.moved_num_items is not None:
            return self.moved_num_items
        return num_items.to(device) if torch.is_tensor(num_items) else num_items

    def end(self, state: PatchState, completed: bool) -> None:
        """Drop the check if no loss took it; after a forward that ``completed`` (no error), begin
        none for this patch again then: its model changes its labels, or takes another loss."""
        if early_checks.drop(self.key) and completed:
            state.labels_ahead_missed = True


def _vocab_and_device(head: nn.Module) -> tuple[int, torch.device] | None:
    """The head's vocabulary size and device, where its loss runs over the full vocabulary."""
    weight = head_tensor(head, "weight")
    vocab = getattr(head, "out_features", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(vocab, int):
        return None
    if hasattr(weight, "placements") and not head_weight_is_managed(head):  # a tensor-parallel shard
        return None
    return vocab, weight.device


def begin_labels_ahead(head: nn.Module, state: PatchState, call: dict[str, Any]) -> LabelsAhead | None:
    """Shift the call's labels and begin their check, where the stock causal-LM loss will take
    them (the caller swaps it in); ``None`` where nothing was begun."""
    labels = call.get("labels")
    if (
        state.labels_ahead_missed
        or torch.compiler.is_compiling()
        or not state.options.tuning.check_labels_ahead
        or not isinstance(labels, torch.Tensor)
        or labels.dim() == 0
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
        or call.get("shift_labels") is not None
    ):
        return None
    where = _vocab_and_device(head)
    if where is None:
        return None
    vocab, device = where
    shifted = F.pad(labels, (0, 1), value=STOCK_IGNORE_INDEX)[..., 1:]
    targets = shifted.to(device=device, dtype=torch.int64).contiguous()
    num_items = call.get("num_items_in_batch")
    moved = num_items.to(device) if torch.is_tensor(num_items) else None
    key = check_labels_ahead(
        targets,
        vocab,
        options=state.options,
        num_items_in_batch=moved if moved is not None else num_items,
        ignore_index=STOCK_IGNORE_INDEX,
        reduction="mean",
    )
    return None if key is None else LabelsAhead(labels, targets, num_items, moved, key)
