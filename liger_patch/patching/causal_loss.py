"""transformers' causal-LM loss on deferred logits: what the patched forward puts in place of the
model's stock ``loss_function`` for the call."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from liger_patch.patching.deferred import DeferredLogits
from liger_patch.patching.seam import LossRequest, UnfusableLogitsUse

__all__ = ["causal_lm_loss"]


def causal_lm_loss(
    logits: Any,
    labels: torch.Tensor | None = None,
    vocab_size: int | None = None,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (same arguments, same label shift) on deferred logits.

    Position t predicts token t+1: labels are shifted left by one and the last position gets
    ``ignore_index``; ``shift_labels`` (already shifted, e.g. by context parallelism) wins.
    ``num_items_in_batch`` divides the sum, as there, and 0 of them gives 0, not NaN.
    """
    if not isinstance(logits, DeferredLogits):
        from transformers.loss.loss_utils import ForCausalLMLoss

        return ForCausalLMLoss(
            logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )
    if vocab_size is not None and vocab_size != logits.shape[-1]:
        raise UnfusableLogitsUse(
            f"its loss reads vocab_size={vocab_size} but the head gives {logits.shape[-1]} logits per token"
        )
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.to(logits.device)
    if targets.numel() * logits.shape[-1] != logits.numel():
        raise ValueError(
            f"liger_patch: labels give {targets.numel()} targets but the model produced "
            f"{logits.numel() // logits.shape[-1]} positions (logits {tuple(logits.shape)}); labels must "
            "cover the kept positions"
        )
    flat = logits.view(-1, logits.shape[-1])
    return flat.loss(
        LossRequest(
            targets=targets.reshape(-1),
            ignore_index=ignore_index,
            reduction="mean",
            num_items_in_batch=num_items_in_batch,
        )
    )
