"""transformers' causal-LM loss on deferred logits: what the patched forward puts in place of the
model's stock ``loss_function`` for the call."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from liger_patch.patching.deferred import DeferredLogits, fused_or_real
from liger_patch.patching.lazy import lazy_imports
from liger_patch.patching.seam import LossRequest

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
    ``num_items_in_batch`` divides the sum, as there, and 0 of them gives 0, not NaN. What has no
    fused counterpart is transformers' own loss on the real logits.
    """

    def real_loss(real: torch.Tensor) -> torch.Tensor:
        stock = lazy_imports()["causal_lm_loss"]  # transformers' ForCausalLMLoss
        return stock(real, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)

    if not isinstance(logits, DeferredLogits) or logits.source.logits is not None:
        return real_loss(logits if not isinstance(logits, DeferredLogits) else logits.materialize())
    if vocab_size is not None and vocab_size != logits.shape[-1]:
        reason = (
            f"its loss reads vocab_size={vocab_size} but the head gives {logits.shape[-1]} logits per token"
        )
        return real_loss(logits.real(reason))
    shifted = shift_labels
    if shifted is None:
        ahead = logits._call.labels_ahead  # the same shift, begun before the body (labels_ahead.py)
        shifted = None if ahead is None else ahead.targets_for(labels, ignore_index)
    if shifted is None:
        shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shifted.to(logits.device)
    if targets.numel() * logits.shape[-1] != logits.numel():
        raise ValueError(
            f"liger_patch: labels give {targets.numel()} targets but the model produced "
            f"{logits.numel() // logits.shape[-1]} positions (logits {tuple(logits.shape)}); labels must "
            "cover the kept positions"
        )
    flat = logits.view(-1, logits.shape[-1])
    request = LossRequest(
        targets=targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="mean",
        num_items_in_batch=num_items_in_batch,
    )
    return fused_or_real(flat, request, lambda _: real_loss(logits.materialize()))
