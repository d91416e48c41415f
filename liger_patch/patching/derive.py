"""A :class:`ModelSpec` for any model, class or model_type: a registry row, else derived, else refused.

Derivation needs no table: the generic forward runs the model's own forward with its output
projection captured (``deferred.py``), so all a spec must say is *where* that projection is,
and ``get_output_embeddings()`` says it. What derivation checks is whether the model can be
served exactly at all:

* it is an ``nn.Module`` whose ``forward`` takes ``labels`` (no labels, no loss to fuse);
* its model_type is not one the verification sweep found to differ (:data:`KNOWN_MISMATCHES`,
  each with how; ``python -m liger_patch verify`` re-checks them);
* on an instance: ``get_output_embeddings()`` names a submodule (``head.fusable_head`` then
  checks that it is a plain ``nn.Linear`` on every call).

A row registered with ``register_model`` wins over derivation. Anything that does not fit is
refused with the reason, never patched on a guess; a forward that later uses its logits in a
way with no exact fused counterpart falls back to its original path and says why.
"""

from __future__ import annotations

import inspect

import torch.nn as nn

from liger_patch.patching.head import head_path
from liger_patch.patching.registry import (
    ModelSpec,
    UnsupportedModelError,
    registered_rows,
    row_for,
    row_for_model_type,
)

__all__ = [
    "CAUSAL_LM",
    "IMAGE_TEXT_TO_TEXT",
    "KNOWN_MISMATCHES",
    "TASKS",
    "classes_for_model_type",
    "derived_spec",
    "instance_refusal",
    "mapped_model_types",
    "spec_for",
    "spec_for_model_type",
    "supported_models",
]

CAUSAL_LM = "causal-lm"
IMAGE_TEXT_TO_TEXT = "image-text-to-text"
TASKS = (CAUSAL_LM, IMAGE_TEXT_TO_TEXT)
_MAPPINGS = {
    CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    IMAGE_TEXT_TO_TEXT: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}

KNOWN_MISMATCHES: dict[str, str] = {}
"""model_type -> how its fused training step differs: types the verification sweep found to
differ from the unpatched step (a **failed** verdict). Derivation refuses them, with this
reason, until they are fixed; empty means none is known."""


def mapped_model_types(task: str) -> dict[str, str]:
    """model_type -> class name, as the installed transformers maps them for ``task``."""
    from transformers.models.auto import modeling_auto

    if task not in _MAPPINGS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return dict(getattr(modeling_auto, _MAPPINGS[task], {}))


def classes_for_model_type(model_type: str) -> list[type]:
    """The classes the installed transformers maps ``model_type`` to (causal LM first, then
    image-text-to-text), without duplicates; empty when it maps none."""
    import transformers

    classes: list[type] = []
    for task in TASKS:
        name = mapped_model_types(task).get(model_type)
        cls = getattr(transformers, name, None) if name else None
        if isinstance(cls, type) and cls not in classes:
            classes.append(cls)
    return classes


def _model_type_of(cls: type) -> str:
    return getattr(getattr(cls, "config_class", None), "model_type", "") or ""


def _class_refusal(cls: type) -> str | None:
    """Why ``cls`` cannot be patched (checked without an instance), or ``None``."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return f"{getattr(cls, '__name__', cls)!r} is not an nn.Module class"
    model_type = _model_type_of(cls)
    if model_type in KNOWN_MISMATCHES:
        return f"model_type {model_type!r} is refused: {KNOWN_MISMATCHES[model_type]}"
    try:
        parameters = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return f"{cls.__name__}.forward has no inspectable signature"
    if "labels" not in parameters:
        return f"{cls.__name__}.forward takes no labels, so it computes no loss to fuse"
    return None


def derived_spec(cls: type) -> ModelSpec:
    """The spec derived for ``cls``; :class:`UnsupportedModelError` with the reason if none fits."""
    reason = _class_refusal(cls)
    if reason is not None:
        raise UnsupportedModelError(
            f"liger_patch cannot patch {cls.__module__}.{cls.__qualname__}: {reason}."
        )
    return ModelSpec(model_type=_model_type_of(cls), class_name=cls.__name__, derived=True)


def spec_for(cls: type) -> ModelSpec:
    """The registered row for ``cls`` (it wins), else its derived spec; raises
    :class:`UnsupportedModelError` with the reason when neither fits."""
    row = row_for(cls)
    return row if row is not None else derived_spec(cls)


def spec_for_model_type(model_type: str) -> list[tuple[type, ModelSpec]]:
    """``(class, spec)`` for each class ``model_type`` names (a row registered under it names
    its own class); :class:`UnsupportedModelError` when it names none."""
    row = row_for_model_type(model_type)
    if row is not None and row.class_name:
        import transformers

        cls = getattr(transformers, row.class_name, None)
        if isinstance(cls, type):
            return [(cls, row)]
    classes = classes_for_model_type(model_type)
    if not classes:
        import transformers

        raise UnsupportedModelError(
            f"liger_patch: the installed transformers {transformers.__version__} maps model_type "
            f"{model_type!r} to no causal-LM or image-text-to-text class. Register your class with "
            "liger_patch.register_model(YourClass, liger_patch.ModelSpec(...)), or patch the model instance."
        )
    return [(cls, spec_for(cls)) for cls in classes]


def instance_refusal(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why the instance ``model`` cannot be patched with ``spec`` (its output projection cannot
    be found), or ``None``."""
    from liger_patch.patching.registry import missing_path_message

    if spec.head:
        problem = missing_path_message(model, spec.head)
        if problem is not None:
            return f"the row for it says head={spec.head!r}, but {problem}"
        return None
    if head_path(model, spec) is None:
        return (
            "get_output_embeddings() returns no submodule of it, so its output projection is unknown; "
            "register a ModelSpec(head='<path of the output nn.Linear>')"
        )
    return None


def supported_models(*, derived: bool = True) -> dict[str, ModelSpec]:
    """model_type -> spec for every model this installation can patch (a copy).

    Registered rows come first and win; with ``derived=True`` (the default) every model_type the
    installed transformers maps to a causal-LM or image-text-to-text class follows, when a spec
    derives for it (``spec.derived`` tells the two apart). Deriving imports each class once
    (a few seconds). ``docs/models.md`` lists which of them the verification sweep proved.
    """
    import transformers

    specs = registered_rows()
    if not derived:
        return specs
    for task in TASKS:
        for model_type, class_name in sorted(mapped_model_types(task).items()):
            cls = getattr(transformers, class_name, None)
            if model_type in specs or not isinstance(cls, type):
                continue
            try:
                specs[model_type] = derived_spec(cls)
            except UnsupportedModelError:
                continue
    return specs
