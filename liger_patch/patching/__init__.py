"""Everything that knows about transformers: the registry, the generic forward, apply/revert."""

from liger_patch.patching.apply import apply_liger_to, liger_patched, revert_liger
from liger_patch.patching.registry import (
    ModelSpec,
    MoeAuxLoss,
    UnsupportedModelError,
    register_model,
    supported_models,
)

__all__ = [
    "ModelSpec",
    "MoeAuxLoss",
    "UnsupportedModelError",
    "apply_liger_to",
    "liger_patched",
    "register_model",
    "revert_liger",
    "supported_models",
]
