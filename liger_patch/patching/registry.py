"""Registry rows: hand-written :class:`ModelSpec` entries for what derivation cannot see.

Most models need no row: ``derive.py`` derives their spec (the output projection is what
``get_output_embeddings()`` returns; everything else is the model's own forward, run with that
projection captured). A row is for the exceptions: a model whose ``get_output_embeddings()``
does not name its output projection (:data:`BUILTIN_ROWS`), or a user's own architecture
registered explicitly with :func:`register_model`. A row wins over derivation. It never holds
a forward: every model is served by the one generic forward in ``forward.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

__all__ = [
    "BUILTIN_ROWS",
    "ModelSpec",
    "UnsupportedModelError",
    "get_submodule_path",
    "missing_path_message",
    "register_model",
    "registered_rows",
    "row_for",
    "row_for_model_type",
]


class UnsupportedModelError(TypeError):
    """Raised by ``apply_liger_to(..., strict=True)`` for a model that cannot be patched exactly,
    with the reason (no output projection, no labels, a known mismatch, ...)."""


@dataclass(frozen=True)
class ModelSpec:
    """How the generic fused forward finds a model's output projection.

    Attributes:
        model_type: ``config.model_type`` of the family (``"llama"``).
        class_name: the model class this spec describes (``"LlamaForCausalLM"``).
        head: attribute path of the output projection (an ``nn.Linear``; bias allowed), or
            ``None`` for the module ``model.get_output_embeddings()`` returns.
        notes: one line shown in the models table.
        derived: ``True`` for a spec derived from the model (``derive.py``), ``False`` for a row.
    """

    model_type: str
    class_name: str
    head: str | None = None
    notes: str = ""
    derived: bool = False


def missing_path_message(model: nn.Module, path: str) -> str | None:
    """Why ``model.<path>`` is not a submodule, naming the child modules that are there; else ``None``.

    Registry rows name the body and head by attribute path; a wrong path should be reported as
    such (with what the model does have), not as an AttributeError from inside a forward.
    """
    obj: Any = model
    names = path.split(".")
    for depth, name in enumerate(names):
        child = getattr(obj, name, None)
        if not isinstance(child, nn.Module):
            owner = ".".join([type(model).__name__, *names[:depth]])
            children = ", ".join(n for n, _ in obj.named_children()) or "none"
            return f"{owner} has no submodule {name!r} (path {path!r}); its child modules are: {children}"
        obj = child
    return None


def get_submodule_path(model: nn.Module, path: str) -> Any:
    """``model.<path>`` for a dotted attribute path such as ``"model"`` or ``"transformer.h"``."""
    obj: Any = model
    try:
        for name in path.split("."):
            obj = getattr(obj, name)
    except AttributeError as error:
        message = missing_path_message(model, path) or str(error)
        raise AttributeError(f"liger_patch: {message}; fix the ModelSpec registered for it") from error
    return obj


BUILTIN_ROWS: tuple[ModelSpec, ...] = (
    ModelSpec(
        "blip",
        "BlipForConditionalGeneration",
        head="text_decoder.cls.predictions.decoder",
        notes="get_output_embeddings() returns None; the projection is its text decoder's",
    ),
    ModelSpec(
        "fsmt",
        "FSMTForConditionalGeneration",
        head="model.decoder.output_projection",
        notes="get_output_embeddings() returns an input embedding; the head is output_projection",
    ),
    ModelSpec(
        "nemotron_h_omni",
        "NemotronH_Omni_Reasoning_V3",
        head="language_model.lm_head",
        notes="get_output_embeddings() returns None; the projection is its language model's",
    ),
)
"""The types whose ``get_output_embeddings()`` does not name their output projection (found by the
verification sweep); each row names it."""

# model_type -> row: the built-in rows and the rows users add by model_type.
_ROWS_BY_MODEL_TYPE: dict[str, ModelSpec] = {row.model_type: row for row in BUILTIN_ROWS}
# class -> row, for users' own classes (and transformers classes they re-register).
_ROWS_BY_CLASS: dict[type, ModelSpec] = {}


def registered_rows() -> dict[str, ModelSpec]:
    """Every registered row, keyed by model_type (a copy: editing it changes nothing)."""
    rows = dict(_ROWS_BY_MODEL_TYPE)
    for cls, spec in _ROWS_BY_CLASS.items():
        rows.setdefault(spec.model_type or cls.__name__, spec)
    return rows


def register_model(cls_or_model_type: type[nn.Module] | str, spec: ModelSpec) -> ModelSpec:
    """Add (or replace) a registry row for a user's architecture.

    Pass the causal-LM class itself for your own model code (subclasses match too), or a
    ``model_type`` string for a transformers class named by ``spec.class_name``.
    Returns the row as stored.
    """
    if not isinstance(spec, ModelSpec):
        raise TypeError(f"register_model expects a ModelSpec, got {type(spec).__name__}")
    if isinstance(cls_or_model_type, str):
        stored = dataclasses.replace(spec, model_type=cls_or_model_type)
        _ROWS_BY_MODEL_TYPE[cls_or_model_type] = stored
        return stored
    if isinstance(cls_or_model_type, type):
        stored = dataclasses.replace(spec, class_name=cls_or_model_type.__name__)
        _ROWS_BY_CLASS[cls_or_model_type] = stored
        return stored
    raise TypeError(
        f"register_model expects a model class or a model_type string, got {type(cls_or_model_type).__name__}"
    )


def row_for(cls: type) -> ModelSpec | None:
    """The row for a model class: registered for the class or its nearest registered base
    class (a user's subclass is served by its base's row), else for its config's model_type."""
    for klass in cls.__mro__:
        if klass in _ROWS_BY_CLASS:
            return _ROWS_BY_CLASS[klass]
    model_type = getattr(getattr(cls, "config_class", None), "model_type", None)
    row = _ROWS_BY_MODEL_TYPE.get(model_type) if model_type else None
    if row is not None and row.class_name in ("", cls.__name__):
        return row
    return None


def row_for_model_type(model_type: str) -> ModelSpec | None:
    """The row registered under ``model_type``, else ``None``."""
    return _ROWS_BY_MODEL_TYPE.get(model_type)
