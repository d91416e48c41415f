"""PEFT wrappers on the output head: which ones the fused loss reads exactly, and how.

* ``modules_to_save=["lm_head"]`` (``ModulesToSaveWrapper``): the copy PEFT would run (the active
  adapter's trainable copy, or the original with adapters disabled) is a plain head, fused as one.
* LoRA (``peft.tuners.lora.Linear``) on a plain linear base: ``h (W + s B A)^T = h W^T + u B^T``
  with ``u = s A dropout(h)``. :func:`low_rank_term` computes ``u`` with PEFT's own modules
  (input cast, dropout, ``lora_A``, scaling: plain LoRA and rsLoRA alike) for every active adapter
  PEFT's forward would apply, concatenated along the rank with their ``lora_B`` weights, and the op
  adds ``u B^T`` to each logits chunk (``ops/cross_entropy/low_rank.py``): no ``V x H`` copy of the effective
  weight, and the gradients of ``lora_A``, ``lora_B`` and the hidden states come from autograd
  through ``u`` and ``B``. Disabled adapters (``disable_adapter()``) and merged ones
  (``merge_adapter()``: the base weight holds ``B A`` already) add no term, as in PEFT's forward.
* Everything else falls back, with a reason that names it (:func:`unfusable_wrapper_reason`): other
  tuner layers (IA3, LoHa, ...), trainable tokens on a tied head, LoRA variants (DoRA, aLoRA, ...),
  ``lora_bias``, and a merged layer with adapters disabled (PEFT unmerges it on its next call). A
  quantized or custom base layer is refused by ``head.fusable_head``, which checks the base.

Dropout: ``u`` is computed when the loss runs, right after the head's call in every causal LM's
forward, on the same hidden states; the dropout mask is therefore drawn from the same random
stream, in the same order, as in PEFT's own forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from liger_patch.patching.lazy import lazy_imports

__all__ = ["base_layer", "is_lora_head", "low_rank_term", "unfusable_wrapper_reason"]


def _lora_linear() -> type | tuple[()]:
    """peft's LoRA ``Linear`` (``()`` without peft)."""
    try:
        from peft.tuners.lora.layer import Linear
    except ImportError:
        return ()
    return Linear


def is_peft_layer(module: nn.Module) -> bool:
    """True for peft tuner layers (LoRA & co.) and its auxiliary wrappers (trainable tokens)."""
    return isinstance(module, lazy_imports()["peft_tuner_layer"]) or type(module).__module__.startswith(
        "peft."
    )


def is_lora_head(module: nn.Module) -> bool:
    """True for a peft LoRA ``Linear`` layer (its base layer is checked by the caller)."""
    lora = _lora_linear()
    return bool(lora) and isinstance(module, lora)


def base_layer(head: nn.Module) -> nn.Module:
    """The layer whose weight and bias the op reads: a LoRA layer's base, else ``head`` itself."""
    return head.get_base_layer() if is_lora_head(head) else head


def _applied_adapters(layer: nn.Module) -> list[str]:
    """The adapters PEFT's forward adds to the base output now: the active ones that the layer
    has, none when adapters are disabled or merged into the base weight."""
    if layer.disable_adapters or layer.merged:
        return []
    return [name for name in layer.active_adapters if name in layer.lora_A]


def _adapter_reason(layer: nn.Module, name: str) -> str:
    variant = layer.lora_variant.get(name)
    if variant is not None:
        kind = "DoRA" if "Dora" in type(variant).__name__ else "a LoRA variant"
        return f"its adapter {name!r} is {kind} ({type(variant).__name__}), whose output is not h W^T + u B^T"
    if layer.lora_bias.get(name):
        return f"its adapter {name!r} has lora_bias=True"
    if type(layer.lora_A[name]) is not nn.Linear or type(layer.lora_B[name]) is not nn.Linear:
        return f"its adapter {name!r} has lora_A/lora_B that are not plain nn.Linear layers"
    return ""


def unfusable_wrapper_reason(head: nn.Module, path: str) -> str:
    """Why the PEFT wrapper ``head`` (the copy a ``ModulesToSaveWrapper`` would run, already
    resolved) cannot be fused exactly, ``""`` when it can or is no PEFT wrapper."""
    if not is_peft_layer(head):
        return ""
    kind = type(head).__name__
    if not is_lora_head(head):
        what = " (trainable tokens: trainable_token_indices)" if "TrainableTokens" in kind else ""
        return (
            f"its {path} is a PEFT {kind} layer{what}, whose output the fused loss cannot form from the "
            "head's tensors without a V x H copy; only plain LoRA and modules_to_save are fused"
        )
    if layer_reason := _layer_reason(head):
        return f"its {path} is a PEFT LoRA layer and {layer_reason}"
    return ""


def _layer_reason(layer: nn.Module) -> str:
    if layer.merged and layer.disable_adapters:
        return "its merged adapters are disabled (PEFT unmerges them in its own next call)"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True"
    for name in _applied_adapters(layer):
        if reason := _adapter_reason(layer, name):
            return reason
    return ""


def low_rank_term(layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(u, B)`` of a LoRA head for ``hidden`` (..., H): ``u`` (..., r) ``= s A dropout(h)`` and
    ``B`` (V, r), the active adapters concatenated along r (``None`` when none applies), computed
    with the layer's own modules so that autograd reaches ``lora_A`` and ``lora_B``."""
    us, bs = [], []
    for name in _applied_adapters(layer):
        lora_a = layer.lora_A[name]
        x = layer._cast_input_dtype(hidden, lora_a.weight.dtype)
        us.append(lora_a(layer.lora_dropout[name](x)) * layer.scaling[name])
        bs.append(layer.lora_B[name].weight)
    if not us:
        return None
    if len(us) == 1:
        return us[0], bs[0]
    dtype = torch.promote_types(us[0].dtype, bs[0].dtype)
    return torch.cat([u.to(dtype) for u in us], -1), torch.cat([b.to(dtype) for b in bs], -1)
