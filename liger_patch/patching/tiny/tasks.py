"""The tasks, and the model types and classes the installed transformers maps to each."""

from __future__ import annotations

from typing import Any

import transformers
from transformers.models.auto import modeling_auto

from liger_patch.patching.tiny.errors import TinyModelError

CAUSAL_LM = "causal-lm"


IMAGE_TEXT_TO_TEXT = "image-text-to-text"


_MAPPINGS = {
    CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    IMAGE_TEXT_TO_TEXT: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}


def model_types(task: str) -> list[str]:
    """Sorted model types the installed transformers maps to a class for ``task``."""
    return sorted(_mapping(task))


def model_class(model_type: str, task: str = CAUSAL_LM) -> type:
    """The class the auto mapping names for ``model_type`` under ``task``."""
    name = _mapping(task).get(model_type)
    if name is None:
        raise TinyModelError(f"{model_type}: no {task} class in transformers {transformers.__version__}")
    if isinstance(name, (tuple, list)):
        name = name[0]
    cls = getattr(transformers, name, None)
    if cls is None:
        raise TinyModelError(f"{model_type}: transformers does not export {name}")
    return cls


def _mapping(task: str) -> dict[str, Any]:
    """The auto mapping (model_type -> class name) for a task."""
    if task not in _MAPPINGS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(_MAPPINGS)}")
    return dict(getattr(modeling_auto, _MAPPINGS[task]))


def config_class_of(model_type: str) -> type:
    """The config class registered for ``model_type``."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError as err:
        raise TinyModelError(f"{model_type}: no config class") from err
