"""The seam between deferred logits and the fused loss: what a loss call asks, what answers it,
and what one fused forward records.

The model's own loss call on deferred logits (transformers' causal-LM loss or ``F.cross_entropy``)
states what it wants as a :class:`LossRequest`. The deferred logits add what they are (the head,
its input hidden states, and the ``logit_scale`` / ``softcap`` their recorded ops amount to) and
hand everything, by keyword, to the call's :class:`DeferredLoss`: the patched forward's, which
adds the patch's options. :class:`CapturedCall` is what the forward reads back afterwards,
including why a use of its logits had no fused counterpart (``refusal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn

__all__ = ["CapturedCall", "DeferredLoss", "LossRequest", "LossResult", "UnfusableLogitsUse"]


class UnfusableLogitsUse(RuntimeError):
    """The model's forward used its logits in a way the fused loss cannot reproduce exactly.

    Raised inside the seam (a loss request that cannot be fused, which its caller answers from the
    real logits) and by :meth:`CapturedCall.refuse` for a ``strict`` call; a patched forward's
    call is not strict, so its forward goes on with the real logits."""


# Not frozen: torch 2.11's dynamo loses the fields a frozen dataclass's __init__ sets while
# it traces a compiled patched model (the compile tests failed there).
@dataclass(kw_only=True)
class LossRequest:
    """One loss call on deferred logits, as the model made it.

    ``targets`` has the token shape of the logits (shifted already, where the loss shifts);
    ``reduction`` is ``"mean"``, ``"sum"`` or ``"none"``, and ``num_items_in_batch`` (a number or
    a tensor) replaces the mean's divisor when given.
    """

    targets: torch.Tensor
    ignore_index: int = -100
    reduction: str = "mean"
    num_items_in_batch: Any = None
    label_smoothing: float = 0.0


LossResult = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""The loss, and the op's other outputs by name (``z_loss``, ``token_accuracy``, ...)."""


class DeferredLoss(Protocol):
    """The loss side of the seam: the fused loss of ``softcap(logit_scale * (head(hidden) + bias))``
    (each ``None`` when absent; ``bias`` a constant ``(V,)`` added to the head's own) against
    ``request``."""

    def __call__(
        self,
        *,
        head: nn.Module,
        hidden: torch.Tensor,
        logit_scale: float | None,
        softcap: float | None,
        bias: torch.Tensor | None,
        request: LossRequest,
    ) -> LossResult: ...


@dataclass
class CapturedCall:
    """One fused forward: what computes its losses, and what happened.

    ``head_calls`` counts calls of the captured head, ``weight_reads`` reads of its ``weight``
    through the capture (code that makes the logits from the weight itself, when it never calls
    the head), ``losses`` the losses taken from its deferred logits; ``z_losses`` collects every
    loss's z-loss term and ``outputs`` holds the other outputs of the last loss. ``refusal`` is
    the first use of its logits that had no fused counterpart (its real logits were made for it);
    a ``strict`` call raises :class:`UnfusableLogitsUse` there instead (a caller that runs the
    model's own path itself). ``labels_ahead`` is the forward's labels shifted, their check begun
    before its body (``labels_ahead.LabelsAhead``), for the causal-LM loss to take.
    """

    compute_loss: DeferredLoss
    strict: bool = False
    refusal: str | None = None
    head_calls: int = 0
    weight_reads: int = 0
    losses: int = 0
    z_losses: list[torch.Tensor] = field(default_factory=list)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    labels_ahead: Any = None

    def refuse(self, reason: str) -> None:
        """Record ``reason`` (the first one stays); a strict call raises it."""
        if self.strict:
            raise UnfusableLogitsUse(reason)
        if self.refusal is None:
            self.refusal = reason

    def record_loss(self, result: LossResult) -> torch.Tensor:
        """Count one loss, keep its z-loss and other outputs; return the loss itself."""
        loss, outputs = result
        self.losses += 1
        z_loss = outputs.pop("z_loss", None)
        if z_loss is not None:
            self.z_losses.append(z_loss)
        self.outputs.update(outputs)
        return loss
