"""The fused linear cross-entropy op. Knows nothing of transformers."""

from liger_patch.ops.fused_linear_ce import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy

__all__ = ["FusedLinearCrossEntropyLoss", "fused_linear_cross_entropy"]
