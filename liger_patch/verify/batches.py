"""A deterministic training batch for a tiny model: ids, mask, labels and, for a
vision-language model, its images with the right number of placeholder tokens; and the
per-type batch code (whole batches of types whose inputs are not ids + labels (+ images), and
fixups adding the extra inputs a few types need).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.derive import MASKED_LM, SEQ2SEQ_LM, SPEECH_SEQ2SEQ
from liger_patch.verify.config_rules import is_int, type_key
from liger_patch.verify.images import Images, image_inputs
from liger_patch.verify.lm_batches import lm_batch, task_of
from liger_patch.verify.models import forward_params, random_ids, special_ids, text_config, vocab_limit
from liger_patch.verify.sizes import LEFT_PAD


def example_batch(
    model: nn.Module, *, seed: int = 0, batch_size: int = 2, seq_len: int = 16, task: str | None = None
) -> dict:
    """A deterministic training batch for ``model`` (of the family ``task``; by default the one
    whose mapping names its class, ``lm_batches.task_of``).

    ``input_ids`` are random ordinary tokens (no special ids), ``labels`` copy them with -100 at
    the first, middle and last position of each row and on image placeholders,
    ``attention_mask`` is ones except for the left padding of the last row. For a
    vision-language model the batch also has the image inputs its forward needs, one image per
    row, with as many placeholder tokens as the vision path yields features (so rows are
    longer than ``seq_len``). An encoder-decoder, speech or masked-LM model gets its family's
    batch instead (``lm_batches.lm_batch``): decoder labels of their own, audio features, about
    15 % of the positions labelled. Only arguments the forward accepts are included; tensors are
    float32 / int64 on the model's device.
    """
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    hook = BATCH_HOOKS.get(type_key(model.config))
    if hook is not None:
        batch = hook(model, gen, batch_size, seq_len)
    else:
        images = image_inputs(model, gen, batch_size)
        batch = _text_batch(model, gen, batch_size, seq_len, images)
        fixup = BATCH_FIXUPS.get(type_key(model.config))
        if fixup is not None:
            fixup(model, batch, gen)
        task = task or task_of(model)
        if task in (SEQ2SEQ_LM, SPEECH_SEQ2SEQ, MASKED_LM):
            batch = lm_batch(model, task, gen, batch_size, seq_len, batch)
    params = forward_params(model)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k in params}


def _text_batch(
    model: nn.Module, gen: torch.Generator, batch_size: int, seq_len: int, images: Images | None
) -> dict[str, Any]:
    """Ids, mask and labels; image placeholders (if any) after the first ``LEFT_PAD`` tokens,
    which are padding in the last row (left padding, as generation-style batches have)."""
    params = forward_params(model)
    text, placed = _ids_with_images(model, gen, batch_size, seq_len, images)
    labels = _labels(text, placed)
    batch: dict[str, Any] = {"input_ids": text, "labels": labels}
    if "attention_mask" in params:
        batch["attention_mask"] = _left_padded_mask(model, text, labels)
    if images is not None:
        batch.update(images.inputs)
        for name in ("token_type_ids", "mm_token_type_ids"):
            if name in params:
                batch[name] = (text == images.token_id).long()
    return batch


def _ids_with_images(
    model: nn.Module, gen: torch.Generator, batch_size: int, seq_len: int, images: Images | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ordinary ids with the image placeholders (if any) inserted after ``LEFT_PAD``
    tokens, and the mask of the inserted positions."""
    text = random_ids(gen, (batch_size, seq_len), vocab_limit(model), special_ids(model.config))
    placed = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    if images is not None and images.tokens:
        text, placed = _insert_images(text, images, LEFT_PAD)
    return text, placed


def _labels(text: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
    """The ids as labels, ignored (-100) at the first, middle and last position and on the
    inserted image positions."""
    length = text.shape[1]
    labels = text.clone()
    labels[:, [0, length // 2, length - 1]] = -100
    labels[placed] = -100
    return labels


def _left_padded_mask(model: nn.Module, text: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The attention mask: ones, but with more than one row the last row's first ``LEFT_PAD``
    positions are padding, which also sets their labels to -100 and their ids to the pad id
    (where the config has a valid one), in place."""
    mask = torch.ones_like(text)
    if text.shape[0] > 1:
        mask[-1, :LEFT_PAD] = 0
        labels[-1, :LEFT_PAD] = -100
        pad = getattr(text_config(model.config), "pad_token_id", None)
        if is_int(pad) and 0 <= pad < vocab_limit(model):
            text[-1, :LEFT_PAD] = pad
    return mask


def _insert_images(text: torch.Tensor, images: Images, at: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``text`` with ``[start] image * n [end]`` inserted at position ``at`` of every row, and
    the mask of the inserted positions."""
    rows = text.shape[0]
    markers = [torch.full((rows, 1), t) for t in (images.start_id,) if t is not None]
    run = [torch.full((rows, images.tokens), images.token_id)]
    ends = [torch.full((rows, 1), t) for t in (images.end_id,) if t is not None]
    inserted = torch.cat(markers + run + ends, dim=1)
    out = torch.cat([text[:, :at], inserted, text[:, at:]], dim=1)
    placed = torch.zeros_like(out, dtype=torch.bool)
    placed[:, at : at + inserted.shape[1]] = True
    return out, placed


def _mllama_fixup(model: nn.Module, batch: dict[str, Any], gen: torch.Generator) -> None:
    """Mllama: text after the image token cross-attends to the image's real tile."""
    ids = batch["input_ids"]
    tiles = batch["aspect_ratio_mask"].shape[-1]
    mask = torch.zeros(*ids.shape, 1, tiles, dtype=torch.long)
    mask[:, 1:, :, 0] = 1
    batch["cross_attention_mask"] = mask


def _kosmos2_fixup(model: nn.Module, batch: dict[str, Any], gen: torch.Generator) -> None:
    """Kosmos-2: image features replace the positions flagged by ``image_embeds_position_mask``."""
    batch["image_embeds_position_mask"] = (batch["input_ids"] == model.config.image_token_id).long()


def _idefics_fixup(model: nn.Module, batch: dict[str, Any], gen: torch.Generator) -> None:
    """IDEFICS: images are ``(batch, images, C, H, W)``; every token may attend to the image."""
    batch["pixel_values"] = batch["pixel_values"].unsqueeze(1)
    batch["image_attention_mask"] = torch.ones(*batch["input_ids"].shape, 1, dtype=torch.long)


def _udop_fixup(model: nn.Module, batch: dict[str, Any], gen: torch.Generator) -> None:
    """UDOP: every token has a layout box ``(x0, y0, x1, y1)``, normalised to 0..1."""
    ids = batch["input_ids"]
    corner = torch.rand(*ids.shape, 2, generator=gen) / 2
    batch["bbox"] = torch.cat([corner, corner + 0.1], dim=-1)


def _evolla_fixup(model: nn.Module, batch: dict[str, Any], gen: torch.Generator) -> None:
    """Evolla: the "image" is a protein sequence, tokenised with the protein encoder's vocab."""
    protein = model.config.protein_encoder_config
    ids = random_ids(gen, (batch["input_ids"].shape[0], 12), protein.vocab_size, {0, 1, 2, 3})
    batch["protein_input_ids"] = ids
    batch["protein_attention_mask"] = torch.ones_like(ids)


# Inputs some types need beyond ids, labels and images: model_type -> fixup(model, batch, gen)
BATCH_FIXUPS: dict[str, Callable[[nn.Module, dict[str, Any], torch.Generator], None]] = {
    "evolla": _evolla_fixup,
    "idefics": _idefics_fixup,
    "kosmos_2": _kosmos2_fixup,
    "mllama": _mllama_fixup,
    "udop": _udop_fixup,
}


def _musicgen_batch(model: nn.Module, gen: torch.Generator, batch_size: int, seq_len: int) -> dict[str, Any]:
    """MusicGen decoder: one id row per codebook, labels ``(batch, seq, codebooks)``."""
    books = model.config.num_codebooks
    codes = random_ids(gen, (batch_size, books, seq_len), vocab_limit(model), special_ids(model.config))
    labels = codes.transpose(1, 2).clone()
    labels[:, [0, seq_len // 2, seq_len - 1], :] = -100
    return {
        "input_ids": codes.reshape(batch_size * books, seq_len),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "labels": labels,
    }


# Types whose batch is not ids + labels (+ images): model_type -> builder(model, gen, batch, seq)
BATCH_HOOKS: dict[str, Callable[[nn.Module, torch.Generator, int, int], dict[str, Any]]] = {
    "musicgen_decoder": _musicgen_batch,
    "musicgen_melody_decoder": _musicgen_batch,
}
