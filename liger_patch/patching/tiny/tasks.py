"""The model types and classes the installed transformers maps to each task (the tasks and
their auto mappings are ``derive.py``'s)."""

from __future__ import annotations

import transformers

from liger_patch.patching.derive import CAUSAL_LM, IMAGE_TEXT_TO_TEXT, mapped_model_types
from liger_patch.patching.tiny.errors import TinyModelError

__all__ = ["CAUSAL_LM", "IMAGE_TEXT_TO_TEXT", "config_class_of", "model_class", "model_types"]


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
