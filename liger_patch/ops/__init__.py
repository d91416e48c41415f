"""The fused losses, free of transformers: the cross-entropy (``cross_entropy/``), the
distillation (``distillation/``) and the machinery both share (``core/``)."""

from liger_patch.ops.cross_entropy.functional import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from liger_patch.ops.cross_entropy.logprobs import LogProbs, fused_linear_logprobs
from liger_patch.ops.distillation.functional import FusedLinearDistillationLoss, fused_linear_distillation

__all__ = [
    "FusedLinearCrossEntropyLoss",
    "FusedLinearDistillationLoss",
    "LogProbs",
    "fused_linear_cross_entropy",
    "fused_linear_distillation",
    "fused_linear_logprobs",
]
