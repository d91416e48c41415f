"""The fused linear cross-entropy op. Knows nothing of transformers."""

from liger_patch.ops.fused_linear_ce import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from liger_patch.ops.logprobs import LogProbs, fused_linear_logprobs

__all__ = ["FusedLinearCrossEntropyLoss", "LogProbs", "fused_linear_cross_entropy", "fused_linear_logprobs"]
