"""The output head: where it is, and whether the fused loss may use it.

The head is the module ``get_output_embeddings()`` returns (or the path a registry row names).
The kernel reads ``head.weight`` and ``head.bias`` directly, so fusing is exact only for a plain
linear layer with a dense floating-point weight (:func:`fusable_head` says which, or why not),
or a PEFT LoRA layer over one (its adapters become the op's low-rank term: ``adapters.py``).
A head whose weight a sharding wrapper owns is handled in ``sharded_head.py``.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from liger_patch.patching.adapters import (
    base_layer,
    is_lora_head,
    is_peft_layer,
    low_rank_term,
    unfusable_wrapper_reason,
)
from liger_patch.patching.registry import ModelSpec, get_submodule_path, missing_path_message
from liger_patch.patching.sharded_head import (
    head_tensor,
    is_dtensor,
    lora_sharding_reason,
    sharded_head_reason,
)

__all__ = ["adapter_term", "fusable_head", "head_path", "unfusable_head_message"]

_FLOAT8_DTYPES = tuple(getattr(torch, name) for name in dir(torch) if name.startswith("float8_"))


def _active_modules_to_save_copy(head: nn.Module) -> nn.Module:
    """The module a peft ``ModulesToSaveWrapper`` would run: the trainable copy when active."""
    if not (hasattr(head, "modules_to_save") and hasattr(head, "original_module")):
        return head
    active = list(getattr(head, "active_adapters", []) or [])
    if getattr(head, "disable_adapters", False) or not active or active[0] not in head.modules_to_save:
        return head.original_module
    return head.modules_to_save[active[0]]


def _weight_reason(head: nn.Linear, where: str) -> str:
    """Why the head's weight cannot be read as a dense float tensor (``""`` when it can)."""
    weight = head_tensor(head, "weight")
    if (
        (type(weight) not in (nn.Parameter, torch.Tensor) and not is_dtensor(weight))
        or not weight.is_floating_point()
        or weight.dtype in _FLOAT8_DTYPES
    ):
        return f"its {where} weight is quantized ({type(weight).__name__}, {weight.dtype})"
    if weight.device.type == "meta":
        return f"its {where} weight is offloaded (on the meta device)"
    return ""


# model -> the path its output projection was last found at (walking named_modules() on every
# forward would cost a walk over every submodule of a large model per step).
_HEAD_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None


def head_path(model: nn.Module, spec: ModelSpec) -> str | None:
    """The attribute path of the output projection: the row's ``head``, else the path of the
    module ``model.get_output_embeddings()`` returns (``None`` when it returns none)."""
    if spec.head:
        return spec.head
    module = _output_embeddings(model)
    if module is None:
        return None
    if torch.compiler.is_compiling():
        # Traced once per compiled graph; reading the cache would make the graph's guards depend
        # on every other patched model alive (it recompiled each time one came or went).
        return next((name for name, m in model.named_modules() if m is module and name), None)
    cached = _HEAD_PATHS.get(model)
    if (
        cached is not None
        and missing_path_message(model, cached) is None
        and model.get_submodule(cached) is module
    ):
        return cached
    path = next((name for name, m in model.named_modules() if m is module and name), None)
    if path is not None:
        _HEAD_PATHS[model] = path
    return path


def fusable_head(model: nn.Module, spec: ModelSpec) -> tuple[nn.Module | None, str, str]:
    """``(head, "", path)``: the head the fused loss may use (an ``nn.Linear``, or a PEFT LoRA
    layer over one, ``adapters.py``) and the attribute path it sits at, or ``(None, reason, path)``.

    A PEFT wrapper with no exact fused form (``adapters.unfusable_wrapper_reason``), a quantized
    head or base layer (packed integer/float8 weight or an overridden forward) and an offloaded
    head (weight on ``meta``) all take the original path instead. An FSDP2-sharded weight (a
    DTensor) is fused: ``sharded_head.fused_head_loss`` gathers it; so is a tensor-parallel one
    sharded over the vocabulary (``Shard(0)``), by the vocabulary-parallel op; other DTensor
    shardings are not, nor a LoRA layer on a sharded head (``lora_sharding_reason``).
    """
    path = head_path(model, spec)
    if path is None:
        return None, "it has no output projection (get_output_embeddings() returns None)", ""
    head = _active_modules_to_save_copy(get_submodule_path(model, path))
    reason = unfusable_wrapper_reason(head, path)
    if reason:
        return None, reason, path
    linear = base_layer(head)
    where = f"{path}'s LoRA base layer" if linear is not head else path
    if not isinstance(linear, nn.Linear) or type(linear).forward is not nn.Linear.forward:
        return (
            None,
            f"its {where} is a {type(linear).__name__}, not a plain nn.Linear (a quantized or custom layer)",
            path,
        )
    reason = sharded_head_reason(model, linear) or _weight_reason(linear, where)
    if not reason and is_lora_head(head):
        reason = lora_sharding_reason(model, head, linear)
    return (None, reason, path) if reason else (head, "", path)


def adapter_term(
    model: nn.Module, spec: ModelSpec, hidden: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, str]:
    """For a caller that reads the head's weight itself (TRL's fused head): the low-rank term of
    the model's LoRA head for ``hidden`` (``adapters.low_rank_term``, ``None`` for a head with no
    adapter to add), and ``""``; or ``(None, reason)`` when the head is a PEFT wrapper that cannot
    be fused (its weight alone would drop the adapter)."""
    path = head_path(model, spec)
    if path is None or not is_peft_layer(_active_modules_to_save_copy(get_submodule_path(model, path))):
        return None, ""
    head, reason, _ = fusable_head(model, spec)
    return (None, reason) if head is None else (low_rank_term(head, hidden), "")


def unfusable_head_message(model: nn.Module, reason: str) -> str:
    return f"liger_patch: {type(model).__name__} keeps its original loss path (full logits) because {reason}."
