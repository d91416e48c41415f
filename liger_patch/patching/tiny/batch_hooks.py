"""Per-type batch code: whole batches of types whose inputs are not ids + labels (+ images),
and fixups adding the extra inputs a few types need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.tiny.batch_tokens import random_ids, special_ids, vocab_limit


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
