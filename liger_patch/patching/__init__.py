"""Everything that knows about transformers: the registry, the generic forward, apply/revert."""

from liger_patch.patching.apply import apply_liger_to, liger_patched, revert_liger
from liger_patch.patching.registry import (
    ModelSpec,
    MoeAuxLoss,
    UnsupportedModelError,
    register_model,
    supported_models,
)
from liger_patch.patching.state import PatchState, patch_state

__all__ = [
    "ModelSpec",
    "MoeAuxLoss",
    "PatchState",
    "UnsupportedModelError",
    "apply_liger_to",
    "liger_patched",
    "patch_state",
    "register_model",
    "revert_liger",
    "supported_models",
]
