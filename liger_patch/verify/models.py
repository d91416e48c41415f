"""Tiny random models: the types and classes the installed transformers maps to each task, a
model built of a type's default config or of a user's config, and what its inputs must respect
(the forward's arguments, the vocabulary, the special ids).

The tasks and their auto mappings are ``patching/derive.py``'s.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import transformers
from transformers import PretrainedConfig

from liger_patch.patching.derive import CAUSAL_LM, IMAGE_TEXT_TO_TEXT, MASKED_LM, mapped_model_types
from liger_patch.verify.config_rules import TinyModelError, model_type_of, short
from liger_patch.verify.configs import tiny_config, token_id_values
from liger_patch.verify.overrides import DEFAULT_KWARGS, NO_TINY_MODEL
from liger_patch.verify.sizes import VOCAB


def model_types(task: str) -> list[str]:
    """Sorted model types the installed transformers maps to a class for ``task``."""
    return sorted(mapped_model_types(task))


def model_class(model_type: str, task: str = CAUSAL_LM) -> type:
    """The class the auto mapping names for ``model_type`` under ``task``."""
    name = mapped_model_types(task).get(model_type)
    if name is None:
        raise TinyModelError(f"{model_type}: no {task} class in transformers {transformers.__version__}")
    if isinstance(name, (tuple, list)):
        name = name[0]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise TinyModelError(f"{model_type}: transformers does not export {name}")
    return cls


def config_class_of(model_type: str) -> type:
    """The config class registered for ``model_type``."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError as err:
        raise TinyModelError(f"{model_type}: no config class") from err


def tiny_model(model_type: str, task: str = CAUSAL_LM, *, seed: int = 0) -> nn.Module:
    """A tiny random model of ``model_type`` for ``task``: the class the auto mapping names,
    built from the shrunk default config after ``torch.manual_seed(seed)``, float32, eager
    attention where accepted, dropout and router noise off, in train mode. Whether the patch
    accepts the class is not asked here: that is derivation's rule (the sweep asks it first)."""
    if model_type in NO_TINY_MODEL:
        raise TinyModelError(f"{model_type}: {NO_TINY_MODEL[model_type]}")
    cls = model_class(model_type, task)
    config = _default_config(model_type, cls)
    return tiny_model_from_config(config, cls, seed=seed, bidirectional=task == MASKED_LM)


def _default_config(model_type: str, cls: type) -> PretrainedConfig:
    """The type's default config; when that cannot be built bare (composite configs of older
    versions insist on their parts), the class's own config or a stock encoder/decoder pair."""
    attempts: list[Callable[[], PretrainedConfig]] = [
        lambda: config_class_of(model_type)(**DEFAULT_KWARGS.get(model_type, {}))
    ]
    if getattr(cls, "config_class", None) not in (None, config_class_of(model_type)):
        attempts.append(cls.config_class)
    if hasattr(config_class_of(model_type), "from_encoder_decoder_configs"):
        attempts.append(lambda: _encoder_decoder_config(model_type))
    errors = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for attempt in attempts:
            try:
                return attempt()
            except Exception as err:
                errors.append(short(err))
    raise TinyModelError(f"{model_type}: default config fails: {errors[0]}")


COMPOSITE_ENCODERS = {"encoder-decoder": "bert", "speech-encoder-decoder": "wav2vec2"}
"""The stock encoder of a composite encoder-decoder type (ViT for the others: vision)."""


def _encoder_decoder_config(model_type: str) -> PretrainedConfig:
    """A composite encoder-decoder config from stock parts: the encoder of its kind (BERT for
    text, wav2vec 2.0 for speech, ViT for images) and a BERT decoder."""
    from transformers import AutoConfig

    encoder = AutoConfig.for_model(COMPOSITE_ENCODERS.get(model_type, "vit"))
    decoder = AutoConfig.for_model("bert", is_decoder=True, add_cross_attention=True)
    return config_class_of(model_type).from_encoder_decoder_configs(encoder, decoder)


def tiny_model_from_config(
    config: PretrainedConfig, cls: type | None = None, *, seed: int = 0, bidirectional: bool = False
) -> nn.Module:
    """A tiny random model shaped like ``config`` (shrunk), of class ``cls``.

    ``cls`` defaults to the causal-LM class of the config's type, or its image-text-to-text
    class when the config has a ``vision_config``. ``bidirectional`` (a masked LM) sets
    ``is_decoder=False`` on its text config: Reformer's masked LM refuses a decoder config.
    """
    model_type = model_type_of(config)
    if cls is None:
        task = IMAGE_TEXT_TO_TEXT if getattr(config, "vision_config", None) is not None else CAUSAL_LM
        cls = model_class(model_type, task)
    small = _config_for_class(cls, tiny_config(config))
    if bidirectional:
        text_config(small).is_decoder = False
    model = _build_or_explain(cls, small, seed, model_type)
    _random_logits_biases(model, seed)
    if any(p.dtype != torch.float32 for p in model.parameters() if p.is_floating_point()):
        model = model.float()
    return model.train()


def _random_logits_biases(model: nn.Module, seed: int) -> None:
    """Random values in a constant added to the logits that starts at zero (BART's
    ``final_logits_bias``), so that a patch that dropped it would not match."""
    gen = torch.Generator().manual_seed(seed)
    for name, buffer in model.named_buffers():
        if name.endswith("logits_bias") and buffer.is_floating_point() and not buffer.any():
            buffer.copy_(torch.randn(buffer.shape, generator=gen))


def _build_or_explain(cls: type, config: PretrainedConfig, seed: int, model_type: str) -> nn.Module:
    """The model with eager attention, else with its default attention. A missing package raises
    :class:`TinyModelError` naming it; any other error of the eager attempt is raised as it is
    (the factory did not foresee it: the sweep reports it as a builder error)."""
    try:
        return _build(cls, config, seed, eager=True)
    except ImportError as err:
        raise TinyModelError(f"{model_type}: needs {_missing_packages(err)}, not installed") from err
    except Exception as err:
        try:  # a model that rejects eager attention keeps its default
            return _build(cls, config, seed, eager=False)
        except Exception:
            raise err from None


def _build(cls: type, config: PretrainedConfig, seed: int, *, eager: bool) -> nn.Module:
    """``cls(config)`` with the seed set, optionally asking for eager attention."""
    config = copy.deepcopy(config)
    if eager:
        _set_eager(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        return cls(config)


def _missing_packages(err: ImportError) -> str:
    """The packages an import error names ("the timm library", ``No module named 'scipy'``)."""
    names = re.findall(r"requires the (\S+) library", str(err)) or [err.name or short(err)]
    return " and ".join(dict.fromkeys(names))


def _config_for_class(cls: type, config: PretrainedConfig) -> PretrainedConfig:
    """The (sub)config ``cls`` is built from: a text-only class of a multimodal type takes the
    text config, as the auto classes do."""
    wanted = getattr(cls, "config_class", None)
    if wanted is None or isinstance(config, wanted):
        return config
    return next((sub for sub in _config_tree(config) if isinstance(sub, wanted)), config)


def _set_eager(config: PretrainedConfig) -> None:
    """Ask for eager attention in the config and its sub-configs (plain torch, deterministic)."""
    for cfg in _config_tree(config):
        with contextlib.suppress(Exception):  # a config that refuses keeps its default attention
            cfg._attn_implementation = "eager"


def _config_tree(config: PretrainedConfig) -> Iterator[PretrainedConfig]:
    """``config`` and its nested sub-config objects."""
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            yield from _config_tree(sub)


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
