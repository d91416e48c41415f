"""Everything that knows about transformers: specs (rows and derived), the generic forward, apply/revert."""

from liger_patch.patching.apply import apply_liger_to, liger_patched, revert_liger
from liger_patch.patching.derive import supported_models
from liger_patch.patching.registry import ModelSpec, UnsupportedModelError, register_model
from liger_patch.patching.state import LigerBypassWarning, PatchState, patch_state

__all__ = [
    "LigerBypassWarning",
    "ModelSpec",
    "PatchState",
    "UnsupportedModelError",
    "apply_liger_to",
    "liger_patched",
    "patch_state",
    "register_model",
    "revert_liger",
    "supported_models",
]
