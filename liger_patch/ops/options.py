"""The loss options shared by every backend, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LossOptions:
    """Per-token loss options (see docs/loss.md for the math).

    ``logit_scale`` multiplies the logits before the softcap; ``softcap`` c maps x to
    c * tanh(x / c). ``None`` disables either.
    """

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None
    logit_scale: float | None = None

    @property
    def scale(self) -> float:
        return 1.0 if self.logit_scale is None else float(self.logit_scale)
