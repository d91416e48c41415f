"""Integrations with training frameworks: the HF Trainer callback (``trainer``) and TRL's fused
LM head (``trl``).

Importing this package (``import liger_patch`` does) imports ``trl``, which registers its hook
with ``apply_liger_to``; patching itself never imports an integration."""

from typing import Any

from liger_patch.integrations import trl  # noqa: F401 - registers TRL's kernel hook

__all__ = ["LigerPatchCallback"]


def __getattr__(name: str) -> Any:
    # The callback pulls in transformers' Trainer stack (seconds of imports); ``integrations.trl``
    # does not, and is imported above.
    if name == "LigerPatchCallback":
        from liger_patch.integrations.trainer import LigerPatchCallback

        return LigerPatchCallback
    raise AttributeError(f"module 'liger_patch.integrations' has no attribute {name!r}")
