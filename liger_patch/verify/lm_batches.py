"""Training batches of the families beyond the causal LM: encoder-decoder (``input_ids`` for the
encoder, ``labels`` for the decoder, which the model shifts into its ``decoder_input_ids``),
speech encoder-decoder (audio features of the shape the encoder takes) and masked LM (about 15 %
of the positions labelled, as a masked-LM collator leaves them).

Which inputs a model takes is read off the model (its forward's arguments, its
``main_input_name``, its config's sizes), not off a table of types; a type whose audio input
this cannot shape gets its own entry in ``batches.BATCH_HOOKS``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from liger_patch.patching.derive import MASKED_LM, SEQ2SEQ_LM, SPEECH_SEQ2SEQ, mapped_model_types
from liger_patch.verify.config_rules import TinyModelError, type_key
from liger_patch.verify.models import forward_params, random_ids, special_ids, vocab_limit

__all__ = ["MASKED_SHARE", "TARGET_LEN", "audio_inputs", "lm_batch", "masked_labels", "task_of"]

MASKED_SHARE = 0.15
"""The share of positions a masked-LM batch labels (``DataCollatorForLanguageModeling``'s default)."""

TARGET_LEN = 10
"""Decoder positions of a speech batch."""


def task_of(model: nn.Module) -> str | None:
    """The family (a ``derive.TASKS`` name) whose mapping names the model's class for its type,
    preferring the encoder-decoder families; ``None`` when none does."""
    model_type = getattr(model.config, "model_type", "")
    name = type(model).__name__
    for task in (SPEECH_SEQ2SEQ, SEQ2SEQ_LM, MASKED_LM):
        mapped = mapped_model_types(task).get(model_type)
        if mapped == name or (isinstance(mapped, (tuple, list)) and name in mapped):
            return task
    return None


def masked_labels(ids: torch.Tensor, gen: torch.Generator, share: float = MASKED_SHARE) -> torch.Tensor:
    """``ids`` as masked-LM labels: about ``share`` of the positions kept (at least one per row),
    the rest -100."""
    keep = torch.rand(ids.shape, generator=gen) < share
    keep[:, ids.shape[1] // 2] = True
    return ids.masked_fill(~keep, -100)


def _target_labels(model: nn.Module, gen: torch.Generator, batch_size: int, length: int) -> torch.Tensor:
    """Decoder labels: ordinary ids of the decoder's vocabulary, the first and last ignored."""
    labels = random_ids(gen, (batch_size, length), vocab_limit(model), special_ids(model.config))
    labels[:, [0, length - 1]] = -100
    return labels


def lm_batch(
    model: nn.Module, task: str, gen: torch.Generator, batch_size: int, seq_len: int, text: dict[str, Any]
) -> dict[str, Any]:
    """The batch of ``task`` for ``model``, from its causal-LM style ``text`` batch (ids, mask,
    labels): the same ids with masked-LM labels; for an encoder-decoder, the ids (or audio, for a
    model whose main input is audio) for the encoder and decoder labels of their own; for a
    decoder-only model of an encoder-decoder family (an audio LM), the text batch itself."""
    if task == MASKED_LM and not model.config.is_encoder_decoder:
        return _masked_batch(model, gen, text)
    if _takes_audio(model):
        batch, length = audio_inputs(model, gen, batch_size), TARGET_LEN
    elif model.config.is_encoder_decoder:  # labels as long as the ids: FSMT shifts its ids, not its labels
        batch, length = dict(text), seq_len
    else:  # a decoder with an audio encoder beside it: trained on text as a causal LM
        return text
    batch["labels"] = _target_labels(model, gen, batch_size, length)
    return batch


def _masked_batch(model: nn.Module, gen: torch.Generator, text: dict[str, Any]) -> dict[str, Any]:
    """The text batch with about 15 % of its labelled positions kept and their inputs replaced by other
    ordinary ids (as a masked-LM collator corrupts them: a model that could see its labels would
    predict them from its inputs, with a loss near 0 that says nothing)."""
    ids = text["input_ids"]
    # only where the text batch has a label: not on padding, nor on image placeholders
    labels = masked_labels(ids, gen).masked_fill(text["labels"] == -100, -100)
    kept = labels != -100
    noise = random_ids(gen, tuple(ids.shape), vocab_limit(model), special_ids(model.config))
    corrupted = torch.where(kept & (noise != ids), noise, ids)
    return {**text, "input_ids": corrupted, "labels": labels}


def _takes_audio(model: nn.Module) -> bool:
    """Whether the model's main input is audio (features or samples), not ids."""
    name = getattr(model, "main_input_name", "input_ids")
    params = forward_params(model)
    return name in AUDIO_INPUTS or (name != "input_ids" and any(n in params for n in AUDIO_INPUTS))


AUDIO_INPUTS = ("input_features", "input_values")

FEATURE_SIZES = ("num_mel_bins", "input_feat_per_channel", "feature_projection_input_dim", "feature_size")
"""Config names of an audio encoder's features per frame, in the order they are looked for."""

FRAMES = 64
"""Frames of a ``(batch, frames, features)`` input (a convolutional subsampler takes them to 16 or 8)."""


def _feature_config(config: Any) -> tuple[Any, str] | None:
    """The (sub)config that says how many features a frame has, and the name it says it by: the
    config itself, else its audio encoder's."""
    subs = [getattr(config, key, None) for key in (getattr(config, "sub_configs", None) or {})]
    for cfg in (config, *subs, getattr(config, "encoder", None)):
        for name in FEATURE_SIZES:
            if cfg is not None and isinstance(getattr(cfg, name, None), int):
                return cfg, name
    return None


def audio_inputs(model: nn.Module, gen: torch.Generator, batch_size: int) -> dict[str, torch.Tensor]:
    """The encoder's audio input by its name and the config's sizes: raw ``input_values``
    ``(batch, samples)``; log-mel ``input_features`` ``(batch, mel bins, frames)`` where the config
    also fixes its source positions (Whisper: exactly twice as many frames), else ``(batch,
    frames, features)`` (Speech2Text's, SeamlessM4T's and Parakeet-style encoders), with an
    all-ones ``attention_mask`` where the forward takes one."""
    params = forward_params(model)
    name = getattr(model, "main_input_name", "input_features")
    if name not in AUDIO_INPUTS:  # a composite model (SpeechEncoderDecoder): its encoder's input
        name = getattr(getattr(model, "encoder", None), "main_input_name", None)
        name = name if name in AUDIO_INPUTS else next(n for n in AUDIO_INPUTS if n in params)
    if name == "input_values":
        return {"input_values": torch.randn(batch_size, 4000, generator=gen) * 0.1}
    found = _feature_config(model.config)
    if found is None:
        raise TinyModelError(f"{type_key(model.config)}: no audio feature size in its config for {name}")
    cfg, size_name = found
    features = getattr(cfg, size_name) * (
        getattr(cfg, "input_channels", 1) if size_name == "input_feat_per_channel" else 1
    )
    positions = getattr(cfg, "max_source_positions", None)
    if size_name == "num_mel_bins" and isinstance(positions, int):
        return {"input_features": torch.randn(batch_size, features, 2 * positions, generator=gen)}
    inputs = {"input_features": torch.randn(batch_size, FRAMES, features, generator=gen)}
    if "attention_mask" in params:
        inputs["attention_mask"] = torch.ones(batch_size, FRAMES, dtype=torch.long)
    return inputs
