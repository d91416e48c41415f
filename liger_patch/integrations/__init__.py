"""Integrations with training frameworks (HF Trainer)."""

from liger_patch.integrations.trainer import LigerPatchCallback

__all__ = ["LigerPatchCallback"]
