"""The image inputs of a batch, and how many placeholder tokens the text needs for them.

Placeholders are counted, not guessed: the model's own ``get_image_features`` runs on the
images and the text gets one placeholder per feature vector.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from transformers import PretrainedConfig

from liger_patch.verify.config_rules import TinyModelError, model_type_of, type_key
from liger_patch.verify.image_layouts import (
    IMAGE_TOKENS,
    generic_layout,
    image_side,
    layout_for,
    patch_size,
)
from liger_patch.verify.models import config_value, forward_params, random_ids
from liger_patch.verify.sizes import VOCAB


@dataclasses.dataclass
class Images:
    """Image inputs for one image per row, and how the text must make room for them.

    ``token_id`` None: the model takes images without placeholders in the text (it prepends
    their features, or attends to them from a decoder).
    """

    inputs: dict[str, Any]
    token_id: int | None
    tokens: int = 0
    start_id: int | None = None
    end_id: int | None = None


def image_inputs(model: nn.Module, gen: torch.Generator, batch_size: int) -> Images | None:
    """Image inputs the model's forward takes, or None for a text-only model."""
    config = model.config
    params = forward_params(model)
    vision = _vision_config(config)
    layout = layout_for(config, vision)
    if layout is None:
        if vision is None or "pixel_values" not in params:
            return None
        layout = generic_layout(model, params)
    inputs = layout(model, vision or config, gen, batch_size)
    _add_required_image_args(model, inputs, vision or config, batch_size)
    if "qformer_input_ids" in params:
        _add_qformer_prompt(config, inputs, gen, batch_size)
    return _with_placeholders(model, inputs, batch_size)


def _add_qformer_prompt(
    config: PretrainedConfig, inputs: dict[str, Any], gen: torch.Generator, batch_size: int
) -> None:
    """InstructBLIP style: the Q-Former's own 8-token text prompt, in its own vocabulary."""
    qformer_vocab = getattr(getattr(config, "qformer_config", None), "vocab_size", None) or VOCAB
    inputs["qformer_input_ids"] = random_ids(gen, (batch_size, 8), qformer_vocab, {0})
    inputs["qformer_attention_mask"] = torch.ones(batch_size, 8, dtype=torch.long)


def _with_placeholders(model: nn.Module, inputs: dict[str, Any], batch_size: int) -> Images:
    """``inputs`` with the placeholder the text needs for them: its id, the start / end markers
    around the run, and the run's length (fixed by the config, or counted from the features)."""
    config = model.config
    token_id = config_value(config, *_IMAGE_TOKEN_NAMES)
    images = Images(inputs=inputs, token_id=token_id)
    if token_id is None:
        return images
    images.start_id = config_value(config, "vision_start_token_id", "boi_token_id", "boi_token_index")
    images.end_id = config_value(config, "vision_end_token_id", "eoi_token_id", "eoi_token_index")
    fixed = IMAGE_TOKENS.get(type_key(config))
    images.tokens = fixed(config) if fixed else _image_feature_count(model, inputs, batch_size)
    return images


def _vision_config(config: PretrainedConfig) -> PretrainedConfig | None:
    """The vision tower's config: ``vision_config`` (the encoder's, for encoder-decoders), or an
    image encoder's own config."""
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        return vision
    encoder = getattr(config, "encoder", None)
    if isinstance(encoder, PretrainedConfig) and getattr(encoder, "vision_config", None) is not None:
        return encoder.vision_config
    if isinstance(encoder, PretrainedConfig) and getattr(encoder, "image_size", None) is not None:
        return encoder
    return None


# Config names of the placeholder token, image models first, video-only models after.
_IMAGE_TOKEN_NAMES = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _add_required_image_args(
    model: nn.Module, inputs: dict[str, Any], vision: PretrainedConfig, batch_size: int
) -> None:
    """Arguments the image-feature path requires beyond the pixels (image sizes)."""
    fn = _image_feature_fn(model)
    if fn is None:
        return
    required = {
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD
    }
    side = image_side(vision)
    if "image_sizes" in required and "image_sizes" not in inputs:
        inputs["image_sizes"] = torch.tensor([[side, side]] * batch_size)
    for name in required - set(inputs):  # settings some versions want passed explicitly
        value = getattr(model.config, name, None) or getattr(vision, name, None)
        if value is not None:
            inputs[name] = value
    for name in ("target_sizes", "image_grid_hw"):  # the image's size in patches
        if name in required and name not in inputs:
            patches = side // patch_size(vision)
            inputs[name] = torch.tensor([[patches, patches]] * batch_size)


def _image_feature_fn(model: nn.Module) -> Callable | None:
    """The model's ``get_image_features`` (``get_video_features`` for video-only models), from its
    inner base model where it has one: some outer wrappers drop arguments on the way."""
    inner = getattr(model, "model", None)
    for name in ("get_image_features", "get_video_features"):
        for owner in (inner, model):
            fn = getattr(owner, name, None)
            if fn is not None:
                return fn
    return None


def _image_feature_count(model: nn.Module, inputs: dict[str, Any], batch_size: int) -> int:
    """Placeholder tokens per image: the number of feature vectors the vision path yields."""
    fn = _image_feature_fn(model)
    if fn is None:
        raise TinyModelError(f"{model_type_of(model.config)}: no get_image_features to count image tokens")
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in inputs.items() if k in params or takes_any and "qformer" not in k}
    with torch.no_grad():
        feats = _feature_tensors(fn(**kwargs))
    return sum(f.numel() // f.shape[-1] for f in feats) // batch_size


def _feature_tensors(out: Any) -> list[torch.Tensor]:
    """The projected image features in what ``get_image_features`` returns.

    transformers 5 returns an output object whose ``pooler_output`` holds them (one tensor, or
    one per image); 4.x returns the tensor, one per image, or (features, extras) where the
    extras (deep-stack layers, indicator embeddings) are not placeholders.
    """
    if not isinstance(out, (torch.Tensor, list, tuple)):
        pooled = getattr(out, "pooler_output", None)
        stacked = getattr(out, "deepstack_features", None)  # Granite 4 vision: [(layer, features)]
        out = pooled if pooled is not None else stacked[0][1] if stacked else out.last_hidden_state
    if isinstance(out, torch.Tensor):
        return [out]
    per_image = all(isinstance(f, torch.Tensor) and f.shape[1:] == out[0].shape[1:] for f in out)
    if per_image:
        return list(out)
    first = out[0]
    return [first] if isinstance(first, torch.Tensor) else list(first)
