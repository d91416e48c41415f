"""The one generic causal-LM forward that every registry row uses.

``make_liger_forward(original)`` returns a drop-in replacement for a ``*ForCausalLM.forward``.
It keeps the original signature (``functools.wraps``: the Trainer filters dataset columns and
decides whether to pass ``num_items_in_batch`` by inspecting it, and ``generate`` inspects it
too) and decides on every call which path runs:

* **fused** (training with labels, or ``skip_logits=True``): run the decoder body, slice the
  hidden states as ``logits_to_keep`` says, shift the labels exactly as transformers'
  ``ForCausalLMLoss`` does, and hand hidden states + head weight to the fused loss with the
  user's options and what this forward sets per call (:data:`FORWARD_SETS`). No
  ``tokens x vocab`` tensor is built; ``logits`` is ``None`` (a real ``None``: sentinel objects
  break accelerate's evaluation loop). MoE rows add the model's own router load-balancing loss.
* **original** (eval mode, no labels, ``generate``, ``skip_logits=False``, or a head that cannot
  be fused exactly): the unpatched forward runs untouched.

``LIGER_RETURN_LOGITS=1`` (read on every call) keeps the fused loss and also returns the real
logits, computed exactly like the original head does. Reading the call is ``call.py``'s job, the
head's checks and math ``head.py``'s, the patch state ``state.py``'s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from liger_patch import env
from liger_patch.patching.call import (
    LossFields,
    bind_call,
    body_arguments,
    keep_positions,
    pop_loss_fields,
    positional_names,
    set_router_logits_flag,
    targets_for,
    wants_fused_path,
)
from liger_patch.patching.head import fusable_head, head_logits, unfusable_head_message
from liger_patch.patching.lazy import lazy_imports
from liger_patch.patching.registry import ModelSpec, get_submodule_path
from liger_patch.patching.sharded_head import fused_head_loss
from liger_patch.patching.state import STATE_ATTR, PatchState

__all__ = ["FORWARD_SETS", "is_liger_forward", "make_liger_forward", "set_by_forward"]

ORIGINAL_ATTR = "__liger_original__"

FORWARD_SETS = ("ignore_index", "reduction", "softcap", "logit_scale", "return_z_loss")
"""The loss options the patched forward sets on every call (``_per_call_options``), so a patch
does not take them (``apply_liger_to`` refuses them); ``_SOURCES`` says where each comes from."""

_SOURCES = {
    "ignore_index": "the call's ignore_index argument, default -100, as transformers' loss",
    "reduction": "'mean', divided by num_items_in_batch when the call passes it",
    "softcap": "the model's registry row, read on its config",
    "logit_scale": "the model's registry row, read on its config",
    "return_z_loss": "on when z_loss_scale > 0, the term reported as outputs.z_loss",
}
assert tuple(_SOURCES) == FORWARD_SETS


def set_by_forward(names: list[str]) -> str:
    """``name (where the forward takes it from)`` for each of ``names``, for an error message."""
    return "; ".join(f"{name} ({_SOURCES[name]})" for name in names)


def _per_call_options(state: PatchState, fields: LossFields, config: Any) -> dict[str, Any]:
    """The options in :data:`FORWARD_SETS`, for this call (the op applies them to ``state.options``)."""
    return dict(
        ignore_index=fields.ignore_index,
        reduction="mean",
        softcap=state.spec.softcap(config),
        logit_scale=state.spec.logit_scale(config),
        return_z_loss=state.options.z_loss_scale > 0,
    )


def _fused_loss(
    model: nn.Module, head: nn.Linear, hidden: torch.Tensor, fields: LossFields, state: PatchState
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(loss, z_loss)`` of the kept positions; the z-loss term is recorded for the callback."""
    targets = targets_for(hidden, fields)
    num_items_in_batch = fields.num_items_in_batch
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(hidden.device)
    per_call = _per_call_options(state, fields, model.config)
    result = fused_head_loss(  # through the head's own call when FSDP2 / ZeRO-3 owns its weight
        head,
        hidden.reshape(-1, hidden.shape[-1]),
        targets.reshape(-1),
        options=state.options,
        num_items_in_batch=num_items_in_batch,
        **per_call,
    )
    loss, z_loss = result if per_call["return_z_loss"] else (result, None)
    if z_loss is not None and model.training:
        state.z_loss_tracker.add(z_loss)
    return loss, z_loss


def _model_module_function(model: nn.Module, original: Callable, name: str) -> Callable:
    """A function from the module that defines the original forward (the model's own helper)."""
    module = sys.modules.get(getattr(inspect.unwrap(original), "__module__", ""), None)
    func = getattr(module, name, None)
    if func is None:
        module = sys.modules.get(type(model).__module__)
        func = getattr(module, name, None)
    if func is None:
        raise AttributeError(
            f"liger_patch: {type(model).__name__}'s modeling module has no {name}(); set "
            "ModelSpec.moe.loss_func_name to the name its forward uses"
        )
    return func


def _body_field(outputs: Any, name: str) -> Any:
    return outputs.get(name) if hasattr(outputs, "get") else None


def _moe_aux_loss(model: nn.Module, original: Callable, spec: ModelSpec, outputs: Any, call: dict) -> Any:
    """The router load-balancing loss, computed by the model's own function as its forward does."""
    config, moe = model.config, spec.moe
    load_balancing_loss = _model_module_function(model, original, moe.loss_func_name)
    router_logits = _body_field(outputs, "router_logits")
    if router_logits is None:
        router_logits = outputs[-1]
    return load_balancing_loss(
        router_logits,
        getattr(config, moe.num_experts_attr),
        getattr(config, moe.top_k_attr),
        call.get("attention_mask"),
    )


def _as_tuple(output: Any) -> tuple:
    """``output.to_tuple()`` as the unpatched model's ``return_dict=False`` gives it, slot for slot.

    ``to_tuple()`` drops ``None`` fields. The unpatched model always has logits, so dropping the
    fused path's ``None`` logits would shift every later field (``past_key_values`` would land
    where callers read logits). The logits slot is kept (``None``, or the real logits with
    ``LIGER_RETURN_LOGITS=1``); every other field is dropped when ``None``, as the original does.
    """
    values = ((f.name, getattr(output, f.name)) for f in dataclasses.fields(output))
    return tuple(value for name, value in values if value is not None or name == "logits")


def _build_output(spec: ModelSpec, outputs: Any, return_dict: bool, **fields: Any) -> Any:
    """The output the original forward returns (the MoE class for MoE rows), from the loss
    ``fields`` and the body's ``outputs``; a tuple for ``return_dict=False``."""
    z_loss = fields.pop("z_loss")
    for name in ("past_key_values", "hidden_states", "attentions", "router_logits"):
        fields[name] = _body_field(outputs, name)
    output_cls = lazy_imports()["moe_output" if spec.moe is not None else "dense_output"]
    output = output_cls(**{k: v for k, v in fields.items() if k in output_cls.__dataclass_fields__})
    # An attribute, not a field: it stays out of to_tuple() and of the Trainer's logits tuple.
    output.z_loss = z_loss
    return output if return_dict else _as_tuple(output)


def fused_causal_lm_forward(
    model: nn.Module, original: Callable, call: dict[str, Any], head: nn.Linear, state: PatchState
) -> Any:
    """The fused path: body -> last hidden states -> fused linear cross-entropy -> output."""
    spec, config = state.spec, model.config
    fields = pop_loss_fields(call, config)
    output_router_logits = set_router_logits_flag(call, spec, config)

    body = get_submodule_path(model, spec.body)
    outputs = body(**body_arguments(body, call))
    hidden = keep_positions(outputs[0], fields.logits_to_keep)
    loss, z_loss = _fused_loss(model, head, hidden, fields, state)

    aux_loss = None
    if output_router_logits:
        aux_loss = _moe_aux_loss(model, original, spec, outputs, call)
        if torch.is_tensor(aux_loss):  # some versions return a plain 0 when no router logits were recorded
            loss = loss + getattr(config, spec.moe.coef_attr) * aux_loss.to(loss.device)

    logits = head_logits(head, hidden, spec, config) if env.return_logits() else None
    return _build_output(
        spec, outputs, fields.return_dict, loss=loss, aux_loss=aux_loss, logits=logits, z_loss=z_loss
    )


def _warn_unfusable_once(model: nn.Module, state: PatchState, reason: str) -> None:
    if not state.warned_unfusable_head:
        state.warned_unfusable_head = True
        warnings.warn(unfusable_head_message(model, reason), UserWarning, stacklevel=4)


def make_liger_forward(original: Callable, fallback: Callable | None = None) -> Callable:
    """Wrap an unbound ``*ForCausalLM.forward`` with the fused path.

    ``original`` gives the signature (kept via ``functools.wraps``) and, unless ``fallback`` is
    given, is what runs on the original path. ``fallback(self, *args, **kwargs)`` replaces it
    when the instance already had its own forward (another wrapper) that must keep running.
    """
    lazy_imports()  # here, eagerly: the forward itself (maybe under torch.compile) then imports nothing
    run_original = fallback if fallback is not None else original
    names = positional_names(original)

    @functools.wraps(original)
    def liger_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        skip_logits = kwargs.pop("skip_logits", None)
        state: PatchState | None = getattr(self, STATE_ATTR, None)
        call = bind_call(names, args, kwargs) if state is not None else None
        if call is None or not wants_fused_path(self, call.get("labels"), skip_logits):
            return run_original(self, *args, **kwargs)  # unpatched, not fused, or a call it must reject
        head, reason = fusable_head(self, state.spec)
        if head is None:
            _warn_unfusable_once(self, state, reason)
            return run_original(self, *args, **kwargs)
        return fused_causal_lm_forward(self, original, call, head, state)

    setattr(liger_forward, ORIGINAL_ATTR, original)
    return liger_forward


def is_liger_forward(function: Any) -> bool:
    """True for a forward made by :func:`make_liger_forward` (bound or not)."""
    return hasattr(getattr(function, "__func__", function), ORIGINAL_ATTR)
