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
way with no exact fused counterpart goes on with its real logits (made there, its body run once),
says why, and runs its original path from then on.
"""

from __future__ import annotations

import inspect
from typing import Any

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
    "MASKED_LM",
    "SEQ2SEQ_LM",
    "SPEECH_SEQ2SEQ",
    "TASKS",
    "classes_by_task",
    "classes_for_model_type",
    "derived_spec",
    "instance_refusal",
    "mapped_model_types",
    "model_type_refusals",
    "spec_for",
    "spec_for_model_type",
    "supported_models",
]

CAUSAL_LM = "causal-lm"
IMAGE_TEXT_TO_TEXT = "image-text-to-text"
SEQ2SEQ_LM = "seq2seq-lm"
SPEECH_SEQ2SEQ = "speech-seq2seq"
MASKED_LM = "masked-lm"
TASKS = (CAUSAL_LM, IMAGE_TEXT_TO_TEXT, SEQ2SEQ_LM, SPEECH_SEQ2SEQ, MASKED_LM)
"""The families of models with a vocabulary head: every auto mapping of transformers whose classes
take ``labels`` and end in one (decoder-only and vision-language, encoder-decoder, speech
encoder-decoder, masked LM). A model_type string names its class in each of them."""
_MAPPINGS = {
    CAUSAL_LM: "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    IMAGE_TEXT_TO_TEXT: "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    SEQ2SEQ_LM: "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    SPEECH_SEQ2SEQ: "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    MASKED_LM: "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
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


def classes_by_task(model_type: str) -> dict[str, type]:
    """task -> the class the installed transformers maps ``model_type`` to under it, in
    :data:`TASKS` order (a task that maps it to none is left out)."""
    import transformers

    found: dict[str, type] = {}
    for task in TASKS:
        name = mapped_model_types(task).get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        cls = getattr(transformers, name, None) if name else None
        if isinstance(cls, type):
            found[task] = cls
    return found


def classes_for_model_type(model_type: str) -> list[type]:
    """The classes the installed transformers maps ``model_type`` to (in :data:`TASKS` order:
    causal LM first), without duplicates; empty when it maps none."""
    classes: list[type] = []
    for cls in classes_by_task(model_type).values():
        if cls not in classes:
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
    its own class) that can be patched; :class:`UnsupportedModelError` when it names none, or
    when none of them can be (with each one's reason). :func:`model_type_refusals` says which of
    its classes were left out, and why."""
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
            f"{model_type!r} to no class with a vocabulary head ({', '.join(TASKS)}). Register your "
            "class with liger_patch.register_model(YourClass, liger_patch.ModelSpec(...)), or patch "
            "the model instance."
        )
    pairs, refusals = [], []
    for cls in classes:
        try:
            pairs.append((cls, spec_for(cls)))
        except UnsupportedModelError as refusal:
            refusals.append(str(refusal))
    if not pairs:
        raise UnsupportedModelError(" ".join(refusals))
    return pairs


def model_type_refusals(model_type: str) -> dict[type, str]:
    """class -> why it cannot be patched, for each class ``model_type`` names that
    :func:`spec_for_model_type` leaves out."""
    refusals = {}
    for cls in classes_for_model_type(model_type):
        try:
            spec_for(cls)
        except UnsupportedModelError as refusal:
            refusals[cls] = str(refusal)
    return refusals


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


def supported_models(*, derived: bool = True, by_family: bool = False) -> dict[str, Any]:
    """model_type -> spec for every model this installation can patch (a copy).

    Registered rows come first and win; with ``derived=True`` (the default) every model_type the
    installed transformers maps to a class with a vocabulary head (:data:`TASKS`: causal LM,
    image-text-to-text, seq2seq LM, speech seq2seq, masked LM) follows, when a spec derives for
    it (``spec.derived`` tells the two apart; a type of several families gets its first family's
    class). With ``by_family=True``: family -> {model_type -> spec of that family's class}, every
    class a model_type string patches. Deriving imports each class once (seconds).
    ``docs/models.md`` lists which of them the verification sweep proved.
    """
    rows = registered_rows()
    if not derived:
        return rows
    families = {task: _derived_family(task, rows) for task in TASKS}
    if by_family:
        return families
    specs = dict(rows)
    for family in families.values():
        for model_type, spec in family.items():
            specs.setdefault(model_type, spec)
    return specs


def _derived_family(task: str, rows: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
    """model_type -> spec of its ``task`` class, for each type whose class a spec serves (its
    row's, when the row names that class)."""
    import transformers

    family = {}
    for model_type, class_name in sorted(mapped_model_types(task).items()):
        name = class_name[0] if isinstance(class_name, (tuple, list)) else class_name
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type):
            continue
        row = rows.get(model_type)
        if row is not None and row.class_name in ("", name):
            family[model_type] = row
            continue
        try:
            family[model_type] = spec_for(cls)
        except UnsupportedModelError:
            continue
    return family
