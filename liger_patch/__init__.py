"""liger_patch: fused linear cross-entropy for HuggingFace causal LMs, applied in one line."""

from typing import Any

import liger_patch.integrations  # noqa: F401 - integrations register their hooks with patching
from liger_patch.ops import (
    FusedLinearCrossEntropyLoss,
    FusedLinearDistillationLoss,
    LogProbs,
    fused_linear_cross_entropy,
    fused_linear_distillation,
    fused_linear_logprobs,
)
from liger_patch.patching import (
    LigerBypassWarning,
    ModelSpec,
    UnsupportedModelError,
    apply_liger_to,
    liger_patched,
    register_model,
    revert_liger,
    supported_models,
)

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The Trainer callback pulls in transformers' Trainer stack (seconds of imports): load it only
    # when it is asked for.
    if name == "LigerPatchCallback":
        from liger_patch.integrations.trainer import LigerPatchCallback

        return LigerPatchCallback
    raise AttributeError(f"module 'liger_patch' has no attribute {name!r}")


__all__ = [
    "FusedLinearCrossEntropyLoss",
    "FusedLinearDistillationLoss",
    "LigerBypassWarning",
    "LigerPatchCallback",
    "LogProbs",
    "ModelSpec",
    "UnsupportedModelError",
    "__version__",
    "apply_liger_to",
    "fused_linear_cross_entropy",
    "fused_linear_distillation",
    "fused_linear_logprobs",
    "liger_patched",
    "register_model",
    "revert_liger",
    "supported_models",
]
