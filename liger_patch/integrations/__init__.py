"""Integrations with training frameworks: the HF Trainer callback (``trainer``) and TRL's fused
LM head (``trl``)."""

from typing import Any

__all__ = ["LigerPatchCallback"]


def __getattr__(name: str) -> Any:
    # The callback pulls in transformers' Trainer stack (seconds of imports); ``integrations.trl``
    # does not, and ``apply_liger_to`` imports it.
    if name == "LigerPatchCallback":
        from liger_patch.integrations.trainer import LigerPatchCallback

        return LigerPatchCallback
    raise AttributeError(f"module 'liger_patch.integrations' has no attribute {name!r}")
