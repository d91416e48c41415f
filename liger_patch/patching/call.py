"""Reading a causal LM's ``forward`` call: its arguments, and which path it asks for.

The patched forward receives ``(*args, **kwargs)`` in the original's signature. This module turns
them into one ``call`` dict (:func:`bind_call`) and decides whether the call fuses
(:func:`wants_fused_path`). Everything else about the call (labels, ``logits_to_keep``,
``num_items_in_batch``) is read by the model's own forward and loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.nn as nn

__all__ = ["bind_call", "positional_names", "wants_fused_path"]


def positional_names(original: Callable) -> list[str]:
    """The names an unbound ``forward`` takes positionally, after ``self``."""
    parameters = list(inspect.signature(original).parameters.values())[1:]
    return [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]


def bind_call(names: list[str], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``args`` matched to ``names``, plus ``kwargs``, as one dict; ``None`` for a call the
    original must reject itself (too many positional arguments, or one given twice)."""
    if len(args) > len(names) or any(name in kwargs for name in names[: len(args)]):
        return None
    call = dict(zip(names, args, strict=False))
    call.update(kwargs)
    return call


def wants_fused_path(model: nn.Module, labels: Any, skip_logits: bool | None) -> bool:
    """Training with labels fuses; ``skip_logits`` (sent by HF's Trainer) overrides the mode."""
    if skip_logits is None:
        return model.training and labels is not None
    if skip_logits and labels is None:
        raise ValueError("liger_patch: skip_logits=True needs labels: without labels there is no loss")
    return bool(skip_logits)
