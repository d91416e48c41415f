"""Integrations with training frameworks: the HF Trainer callback (``trainer``), TRL's fused
LM head (``trl``) and TRL's distillation trainers (``trl_distillation``, ``trl_gkd``).

Importing this package (``import liger_patch`` does) imports the TRL modules, which register their
hooks with ``apply_liger_to``; patching itself never imports an integration."""

from typing import Any

from liger_patch.integrations import trl, trl_distillation, trl_gkd  # noqa: F401 - each registers its TRL hook

__all__ = ["LigerPatchCallback"]


def __getattr__(name: str) -> Any:
    # The callback pulls in transformers' Trainer stack (seconds of imports); ``integrations.trl``
    # does not, and is imported above.
    if name == "LigerPatchCallback":
        from liger_patch.integrations.trainer import LigerPatchCallback

        return LigerPatchCallback
    raise AttributeError(f"module 'liger_patch.integrations' has no attribute {name!r}")
