"""The causal-LM loss's label check, begun before the model's body runs.

A fused forward's loss waits for its label check where skipping the ignored rows pays for the
wait (``ops/core/kept_rows.py``). Queued by the loss, that check runs after the whole body's GPU
work, and the wait is the host's lead on the GPU. The labels are known when the patched forward
starts, so it shifts them as the stock causal-LM loss will (``causal_loss.causal_lm_loss``) and
begins their check then (``functional.check_labels_ahead``): the loss's call over those targets
takes it, answered long since in a host-bound step. The check, the decisions taken from it and
the results are the same; only when the check's device work runs changes.

Begun only for a call the stock causal-LM loss will take (the model's ``loss_function`` swapped,
``labels`` given and no ``shift_labels``), with the head's full vocabulary on the labels' device
(not a tensor-parallel shard, not an offloaded weight), ``Tuning.check_labels_ahead`` on, not
while compiled nor under inference mode. The loss uses the targets made here only for the very
``labels`` tensor the forward got, unchanged since (its version counter), and the default
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
    """A forward's shifted ``targets`` (int64, contiguous, on the labels' device) made from its
    ``labels`` at version ``labels_version``, and its ``num_items_in_batch`` (``moved_num_items``:
    a tensor of it on that device, at ``num_items_version``), whose label check is queued
    (``key``)."""

    labels: torch.Tensor
    labels_version: int
    targets: torch.Tensor
    num_items: Any
    moved_num_items: torch.Tensor | None
    num_items_version: int | None
    key: tuple

    def targets_for(self, labels: Any, ignore_index: int) -> torch.Tensor | None:
        """The targets made here, for the loss over these very ``labels``, unchanged since (a
        model that writes into its labels gets its own shift); else ``None``."""
        if labels is not self.labels or ignore_index != STOCK_IGNORE_INDEX:
            return None
        return self.targets if labels._version == self.labels_version else None

    def num_items_for(self, num_items: Any, device: torch.device) -> Any:
        """``num_items`` on ``device``: the tensor moved here where it is the forward's own,
        unchanged since, and on that device."""
        moved = self.moved_num_items
        if (
            num_items is self.num_items
            and moved is not None
            and moved.device == device
            and num_items._version == self.num_items_version
        ):
            return moved
        return num_items.to(device) if torch.is_tensor(num_items) else num_items

    def end(self, state: PatchState, completed: bool) -> None:
        """Drop the check if no loss took it; after a forward that ``completed`` (no error), begin
        none for this patch again then: its model changes its labels, or takes another loss."""
        if early_checks.drop(self.key) and completed:
            state.labels_ahead_missed = True


def _vocab(head: nn.Module, labels: torch.Tensor) -> int | None:
    """The head's vocabulary size where its loss runs over the full vocabulary with its weight
    on the labels' device: not a tensor-parallel shard (a DTensor weight, but for one FSDP2
    gathers whole), not a weight held elsewhere (offloaded to the CPU, another GPU)."""
    weight = head_tensor(head, "weight")
    vocab = getattr(head, "out_features", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(vocab, int) or weight.device != labels.device:
        return None
    if hasattr(weight, "placements"):  # a DTensor: whole only when FSDP2 alone gathers it
        mesh = getattr(weight, "device_mesh", None)
        if not head_weight_is_managed(head) or mesh is None or mesh.ndim != 1:
            return None
    return vocab


def _plain(t: Any) -> bool:
    return not torch.is_tensor(t) or not t.is_inference()


def begin_labels_ahead(head: nn.Module, state: PatchState, call: dict[str, Any]) -> LabelsAhead | None:
    """Shift the call's labels and begin their check, where the stock causal-LM loss will take
    them (the caller swaps it in); ``None`` where nothing was begun."""
    labels = call.get("labels")
    num_items = call.get("num_items_in_batch")
    if (
        state.labels_ahead_missed
        or torch.compiler.is_compiling()
        or torch.is_inference_mode_enabled()
        or not state.options.tuning.check_labels_ahead
        or not isinstance(labels, torch.Tensor)
        or labels.dim() == 0
        or labels.is_floating_point()
        or labels.is_complex()
        or labels.dtype == torch.bool
        or not (_plain(labels) and _plain(num_items))
        or call.get("shift_labels") is not None
    ):
        return None
    vocab = _vocab(head, labels)
    if vocab is None:
        return None
    version = labels._version
    shifted = F.pad(labels, (0, 1), value=STOCK_IGNORE_INDEX)[..., 1:]
    targets = shifted.to(torch.int64).contiguous()
    moved = num_items.to(labels.device) if torch.is_tensor(num_items) else None
    key = check_labels_ahead(
        targets,
        vocab,
        options=state.options,
        num_items_in_batch=moved if moved is not None else num_items,
        ignore_index=STOCK_IGNORE_INDEX,
        reduction="mean",
    )
    if key is None:
        return None
    items_version = None if moved is None else num_items._version
    return LabelsAhead(labels, version, targets, num_items, moved, items_version, key)
