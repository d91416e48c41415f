"""A vision tower's input geometry (image side, patch size, channels, merge size) and random
images of it."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from liger_patch.patching.tiny.config_tree import is_int
from liger_patch.patching.tiny.sizes import PATCHES_PER_SIDE


def image_side(vision: PretrainedConfig) -> int:
    """Side of the (square) images the vision tower takes."""
    size = getattr(vision, "image_size", None)
    if isinstance(size, (list, tuple)):
        size = size[0]
    if isinstance(size, dict):
        size = size.get("height") or size.get("shortest_edge")
    if is_int(size):
        return size
    return patch_size(vision) * PATCHES_PER_SIDE


def patch_size(vision: PretrainedConfig) -> int:
    """Patch side of a vision tower."""
    patch = getattr(vision, "patch_size", None)
    if isinstance(patch, (list, tuple)):
        patch = patch[0]
    return patch if is_int(patch) else 14


def channel_count(vision: PretrainedConfig) -> int:
    """Input channels of a vision tower."""
    for name in ("num_channels", "in_channels", "in_chans", "num_channels_image"):
        value = getattr(vision, name, None)
        if is_int(value):
            return value
    return 3


def random_pixels(gen: torch.Generator, lead: tuple[int, ...], vision: PretrainedConfig) -> torch.Tensor:
    """Random images of shape ``lead + (channels, side, side)``."""
    side = image_side(vision)
    return torch.randn(*lead, channel_count(vision), side, side, generator=gen)


def merge_size(vision: PretrainedConfig) -> int:
    """Side of the patch block a grid model merges into one token."""
    for name in ("spatial_merge_size", "merge_kernel_size", "merge_size"):
        value = getattr(vision, name, None)
        if isinstance(value, (list, tuple)):
            value = value[0]
        if is_int(value):
            return value
    return 1
