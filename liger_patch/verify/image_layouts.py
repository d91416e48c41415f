"""Image inputs of one image per row, in the layout each model's forward takes, and the vision
tower's input geometry (image side, patch size, channels, merge size) they are made from.

A layout is picked per type (``IMAGE_LAYOUTS``: the model's type, else its vision tower's, for
a tower several types share) or from the forward's arguments (``generic_layout``).
``IMAGE_TOKENS`` holds the placeholder counts that a type's config fixes instead of its vision
features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from transformers import PretrainedConfig

from liger_patch.verify.config_rules import is_int, type_key
from liger_patch.verify.models import forward_params
from liger_patch.verify.sizes import PATCHES_PER_SIDE, VQ_SIDE

ImageLayout = Callable[[nn.Module, PretrainedConfig, torch.Generator, int], dict[str, Any]]


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


def layout_for(config: PretrainedConfig, vision: PretrainedConfig | None) -> ImageLayout | None:
    """The layout ``IMAGE_LAYOUTS`` names for the model's type, else for its vision tower's."""
    layout = IMAGE_LAYOUTS.get(type_key(config))
    if layout is None and vision is not None:
        layout = IMAGE_LAYOUTS.get(type_key(vision))
    return layout


def generic_layout(model: nn.Module, params: set[str]) -> ImageLayout:
    """The image layout a model's forward arguments point to."""
    if "image_grid_thw" in params:
        return _grid_pixels
    if "pixel_attention_mask" in params:
        return _tiled_pixels
    if getattr(model.config, "image_grid_pinpoints", None):
        return _anyres_pixels
    return _plain_pixels


def _plain_pixels(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """One ``(channels, side, side)`` image per row."""
    return {"pixel_values": random_pixels(gen, (batch,), vision)}


def _grid_pixels(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Qwen2-VL style: flattened patches plus each image's (t, h, w) patch grid."""
    patch = patch_size(vision)
    temporal = getattr(vision, "temporal_patch_size", None) or getattr(vision, "patch_temporal", None) or 1
    merge = merge_size(vision)
    side = 2 * merge
    rows = batch * side * side
    if type_key(model.config) in _PATCH_IMAGE_TYPES:
        pixel_values = torch.randn(rows, channel_count(vision), patch, patch, generator=gen)
    else:
        pixel_values = torch.randn(rows, channel_count(vision) * temporal * patch * patch, generator=gen)
    inputs = {"pixel_values": pixel_values, "image_grid_thw": torch.tensor([[1, side, side]] * batch)}
    if "image_merge_sizes" in forward_params(model):
        inputs["image_merge_sizes"] = torch.tensor([merge] * batch)
    return inputs


# Grid models whose patches stay ``(C, P, P)`` images instead of flat vectors.
_PATCH_IMAGE_TYPES = frozenset({"kimi_k25", "paddleocr_vl"})


def _tiled_pixels(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Idefics style: one tile per image and a mask of its valid pixels."""
    pixel_values = random_pixels(gen, (batch, 1), vision)
    mask = torch.ones(batch, 1, *pixel_values.shape[-2:], dtype=torch.bool)
    return {"pixel_values": pixel_values, "pixel_attention_mask": mask}


def _anyres_pixels(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """LLaVA-NeXT style: a base view plus one high-resolution crop per image."""
    side = image_side(vision)
    pixel_values = random_pixels(gen, (batch, 2), vision)
    return {"pixel_values": pixel_values, "image_sizes": torch.tensor([[side, side]] * batch)}


def _docling_tiles(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Granite-Docling: one tile per image, the mask marks real tiles (not pixels)."""
    return {
        "pixel_values": random_pixels(gen, (batch, 1), vision),
        "pixel_attention_mask": torch.ones(batch, 1, dtype=torch.bool),
    }


def _siglip2_patches(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """SigLIP2 (NaFlex) towers: pre-flattened patches, their grid shape and a patch mask."""
    patch, side = patch_size(vision), PATCHES_PER_SIDE
    count = side * side
    return {
        "pixel_values": torch.randn(batch, count, channel_count(vision) * patch * patch, generator=gen),
        "spatial_shapes": torch.tensor([[side, side]] * batch),
        "pixel_attention_mask": torch.ones(batch, count, dtype=torch.long),
    }


def _two_resolution_pixels(
    model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int
) -> dict:
    """DeepSeek-VL hybrid: a low-resolution view for SigLIP and a high-resolution one for SAM."""
    high = model.config.high_res_vision_config
    return {
        "pixel_values": random_pixels(gen, (batch,), vision),
        "high_res_pixel_values": random_pixels(gen, (batch,), high),
    }


def _fuyu_patches(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Fuyu: no vision tower, raw patches go through one linear layer."""
    patch = patch_size(vision)
    count = (image_side(vision) // patch) ** 2
    return {"pixel_values": torch.randn(batch, count, patch * patch * channel_count(vision), generator=gen)}


def _flattened_patches(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Pix2Struct style: patches with their (row, column) ids in the first two features."""
    side = PATCHES_PER_SIDE
    width = vision.patch_embed_hidden_size
    rows = torch.arange(side).repeat_interleave(side) + 1
    cols = torch.arange(side).repeat(side) + 1
    ids = torch.stack([rows, cols], dim=-1).float().expand(batch, -1, -1)
    patches = torch.randn(batch, side * side, width, generator=gen)
    inputs = {"flattened_patches": torch.cat([ids, patches], dim=-1)}
    if "input_ids" not in forward_params(model):  # encoder-decoder: the mask is the patches'
        inputs["attention_mask"] = torch.ones(batch, side * side, dtype=torch.long)
    if "width" in forward_params(model):
        inputs["width"] = torch.full((batch,), side * patch_size(vision))
        inputs["height"] = torch.full((batch,), side * patch_size(vision))
    return inputs


def _token_tiles(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Inkling 2: one channels-last tile of merge x merge patches per image token, with the
    image's grid counted in tokens."""
    side, tile = 2, patch_size(vision) * merge_size(vision)
    tiles = torch.randn(batch * side * side, tile, tile, channel_count(vision), generator=gen)
    return {"pixel_values": tiles, "image_grid_thw": torch.tensor([[1, side, side]] * batch)}


def _timespace_patches(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Inkling: one channels-last ``(T, P, P, C)`` patch per image (the config's temporal and
    spatial patch sides), which the vision tower folds into one image token."""
    temporal = getattr(vision, "temporal_patch_size", None) or 1
    patch = patch_size(vision)
    return {"pixel_values": torch.randn(batch, temporal, patch, patch, channel_count(vision), generator=gen)}


def _pooled_crops(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Molmo 2: one crop of 4 x 4 patches per image, pooled 2 x 2 into 4 tokens.

    ``image_token_pooling`` lists, for each output token, the flattened patch indices it pools;
    ``image_grids`` gives each image's two token grids (high-res and low-res, the second empty).
    """
    patch, side = patch_size(vision), PATCHES_PER_SIDE
    crops = torch.randn(batch, side * side, patch * patch * channel_count(vision), generator=gen)
    pooling = [
        [b * side * side + (2 * i + di) * side + 2 * j + dj for di in (0, 1) for dj in (0, 1)]
        for b in range(batch)
        for i in range(side // 2)
        for j in range(side // 2)
    ]
    grids = torch.tensor([[side // 2, side // 2, 0, 0]] * batch)
    return {"pixel_values": crops, "image_token_pooling": torch.tensor(pooling), "image_grids": grids}


def _vq_pixels(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Chameleon / Emu3: whole images for the VQ tokenizer (Emu3 also wants their sizes)."""
    inputs = {"pixel_values": torch.randn(batch, 3, VQ_SIDE, VQ_SIDE, generator=gen)}
    if "image_sizes" in forward_params(model):
        inputs["image_sizes"] = torch.tensor([[VQ_SIDE, VQ_SIDE]] * batch)
    return inputs


def _positioned_patches(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Gemma 4: flattened patches with their (x, y) positions, a square the pooler can tile
    (the unified variant takes patches already merged to ``model_patch_size``)."""
    merged = getattr(vision, "model_patch_size", None)
    patch = merged or patch_size(vision)
    side = 2 if merged else 2 * (getattr(vision, "pooling_kernel_size", None) or 1)
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], dim=-1).expand(batch, -1, -1)
    patches = torch.randn(batch, side * side, channel_count(vision) * patch * patch, generator=gen)
    return {"pixel_values": patches, "image_position_ids": positions.clone()}


def _packed_strip(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """MiniCPM-V (NaViT): all images' patches side by side in one ``(1, C, P, n * P)`` strip."""
    patch, side = patch_size(vision), PATCHES_PER_SIDE
    strip = torch.randn(1, channel_count(vision), patch, batch * side * side * patch, generator=gen)
    return {"pixel_values": strip, "target_sizes": torch.tensor([[side, side]] * batch)}


def _patch_rows(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """One flattened patch per row, with each image's (h, w) patch grid."""
    patch, side = patch_size(vision), PATCHES_PER_SIDE
    rows = torch.randn(batch * side * side, channel_count(vision) * patch * patch, generator=gen)
    return {"pixel_values": rows, "image_grid_hw": torch.tensor([[side, side]] * batch)}


def _mllama_tiles(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Mllama: one image of one real tile (aspect ratio 1:1) among ``max_num_tiles``."""
    tiles = vision.max_num_tiles
    tile_mask = torch.zeros(batch, 1, tiles, dtype=torch.long)
    tile_mask[..., 0] = 1
    return {
        "pixel_values": random_pixels(gen, (batch, 1, tiles), vision),
        "aspect_ratio_ids": torch.ones(batch, 1, dtype=torch.long),
        "aspect_ratio_mask": tile_mask,
    }


def _video_frames(model: nn.Module, vision: PretrainedConfig, gen: torch.Generator, batch: int) -> dict:
    """Models taking ``(batch, frames or tiles, C, H, W)``: a one-frame clip (one tile) per row."""
    return {"pixel_values": random_pixels(gen, (batch, 1), vision)}


# Layouts by the type of the model or of its vision tower.
IMAGE_LAYOUTS: dict[str, ImageLayout] = {
    "chameleon": _vq_pixels,
    "deepseek_vl_hybrid": _two_resolution_pixels,
    "emu3": _vq_pixels,
    "fuyu": _fuyu_patches,
    "gemma4": _positioned_patches,
    "gemma4_unified": _positioned_patches,
    "granite_docling": _docling_tiles,
    "inkling2_vision": _token_tiles,
    "inkling_vision": _timespace_patches,
    "instructblipvideo": _video_frames,
    "kosmos_2.5": _flattened_patches,
    "lfm2_vl": _siglip2_patches,
    "minicpm_ocr": _packed_strip,
    "minicpmv4_6": _packed_strip,
    "minicpmv4_7": _packed_strip,
    "mllama": _mllama_tiles,
    "molmo2": _pooled_crops,
    "nemotron_h_omni": _patch_rows,
    "perception_lm": _video_frames,
    "pix2struct": _flattened_patches,
    "udop": _plain_pixels,
}


# Placeholder counts fixed by the config rather than measured from the vision features.
IMAGE_TOKENS: dict[str, Callable[[PretrainedConfig], int]] = {
    "kosmos_2": lambda config: config.latent_query_num,
    "mllama": lambda config: 1,
}
