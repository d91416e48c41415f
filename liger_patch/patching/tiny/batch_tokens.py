"""What a batch's token ids must respect: the vocabulary, special ids, forward arguments."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn as nn
from transformers import PretrainedConfig

from liger_patch.patching.tiny.errors import TinyModelError
from liger_patch.patching.tiny.sizes import VOCAB
from liger_patch.patching.tiny.token_ids import token_id_values


def forward_params(model: nn.Module) -> set[str]:
    """Names the model's forward accepts."""
    return set(inspect.signature(model.forward).parameters)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's text config (the config itself for plain LMs)."""
    try:
        return config.get_text_config(decoder=True)
    except TypeError:
        return config.get_text_config()


def special_ids(config: PretrainedConfig) -> set[int]:
    """Every special token id named anywhere in the config tree, and the image-code ids of a VQ
    vocabulary map (Chameleon masks their logits, so a label there has infinite loss)."""
    vq_codes = (getattr(config, "vocabulary_map", None) or {}).values()
    return set(token_id_values(config.to_dict())) | set(vq_codes)


def config_value(config: PretrainedConfig, *names: str) -> Any:
    """The first of ``names`` set on the config or, failing that, its text config or encoder."""
    for cfg in (config, text_config(config), getattr(config, "encoder", None)):
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None:
                return value
    return None


def vocab_limit(model: nn.Module) -> int:
    """Ids below this are valid inputs: the text vocab, capped by the input embedding rows."""
    vocab = getattr(text_config(model.config), "vocab_size", None) or VOCAB
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        rows = None
    return min(vocab, rows) if rows else vocab


def random_ids(gen: torch.Generator, shape: tuple[int, ...], vocab: int, avoid: set[int]) -> torch.Tensor:
    """Random ids in ``[0, vocab)`` that avoid the special ids."""
    allowed = torch.tensor([i for i in range(vocab) if i not in avoid])
    if allowed.numel() == 0:
        raise TinyModelError(f"no ordinary token ids below {vocab}")
    return allowed[torch.randint(allowed.numel(), (math.prod(shape),), generator=gen)].view(shape)
