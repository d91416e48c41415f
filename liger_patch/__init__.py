"""liger_patch: fused linear cross-entropy for HuggingFace causal LMs, applied in one line."""

from liger_patch.ops import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy

__version__ = "0.1.0"

__all__ = [
    "FusedLinearCrossEntropyLoss",
    "__version__",
    "fused_linear_cross_entropy",
]
