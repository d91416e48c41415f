"""The fused loss on a head whose weight a sharding wrapper owns: FSDP2 and DeepSpeed ZeRO-3.

The fused path never calls ``lm_head(hidden)``; it hands ``lm_head.weight`` to the op. That is
fine on one GPU and under DDP (the weight is a full tensor), but the sharding wrappers only
materialise a weight around its module's *call*:

* **FSDP2** (``torch.distributed.fsdp.fully_shard``). Outside its unit's forward the weight is
  a sharded ``DTensor`` (here ``lm_head`` is its own unit, or shares one with the final norm as
  accelerate builds it). The unit's forward hooks all-gather it before the call, register the
  hook that all-gathers it again for backward, and reduce-scatter its gradient afterwards.
* **DeepSpeed ZeRO-3**. The weight is an empty partition (``ds_status`` NOT_AVAILABLE) until
  the module hooks that DeepSpeed put on ``lm_head`` gather it for the call.

So for such a head the fused loss runs *as the head's forward*: :func:`fused_head_loss` swaps a
loss-computing forward onto the head instance for one ``head(hidden)`` call. Every hook
then runs exactly as for the original ``lm_head(hidden)`` call, including the group-aware hooks of
a multi-module FSDP2 unit (accelerate puts the final norm and ``lm_head`` in one) and DeepSpeed's
gathering hooks. (``torch.distributed.fsdp.register_fsdp_forward_method`` also gives the same
results for FSDP2 in our tests, but runs a unit's pre/post-forward directly rather than through
its module hooks, and knows nothing of DeepSpeed.)

A head that needs no wrapper (plain tensor weight: single device, DDP, or a head inside the root
FSDP2 unit, whose weight the root already gathered) calls the op directly, as before.

A weight that is still sharded *inside* the head's forward (tensor parallelism, a ZeRO-3 model
that was not wrapped by the DeepSpeed engine) raises an error saying what to do, never a shape
error from deep inside a kernel.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn as nn

from liger_patch.ops.fused_linear_ce import fused_loss
from liger_patch.ops.options import DEFAULT_OPTIONS, LossOptions

__all__ = [
    "ShardedHeadError",
    "fused_head_loss",
    "head_weight_is_managed",
    "is_dtensor",
    "is_zero3_partitioned",
    "sharded_head_reason",
    "zero3_unavailable",
]


class ShardedHeadError(RuntimeError):
    """The head's weight is still sharded where the fused loss needs the full weight."""


def _loaded_class(module_name: str, class_name: str) -> type | tuple[()]:
    """``module_name.class_name`` if that module is already imported, else ``()``.

    A DTensor or an FSDP2 module can exist only once its class's module has been imported, so
    looking in ``sys.modules`` answers ``isinstance`` exactly without importing
    ``torch.distributed.fsdp`` / ``.tensor``, which would add half a second to ``import
    liger_patch``. ``()`` matches nothing in ``isinstance`` (also on builds without
    ``torch.distributed``).
    """
    module = sys.modules.get(module_name)
    return getattr(module, class_name, ()) if module is not None else ()


def _dtensor_class() -> type | tuple[()]:
    """``DTensor`` once loaded (FSDP2 shards and tensor-parallel weights are DTensors)."""
    return _loaded_class("torch.distributed.tensor", "DTensor")


def _fsdp_module_class() -> type | tuple[()]:
    """``FSDPModule`` once loaded (``fully_shard`` makes every sharded module one)."""
    return _loaded_class("torch.distributed.fsdp", "FSDPModule")


def is_dtensor(tensor: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (an FSDP2 shard or a tensor-parallel weight)."""
    return isinstance(tensor, _dtensor_class())


def is_zero3_partitioned(tensor: Any) -> bool:
    """True for a parameter that DeepSpeed ZeRO-3 partitions (it carries ``ds_id``/``ds_status``)."""
    return hasattr(tensor, "ds_id") and hasattr(tensor, "ds_status")


def zero3_unavailable(tensor: Any) -> bool:
    """True for a ZeRO-3 parameter whose full data is not gathered right now."""
    if not is_zero3_partitioned(tensor):
        return False
    status = tensor.ds_status
    return getattr(status, "name", str(status)).rsplit(".", 1)[-1] != "AVAILABLE"


def _head_tensors(head: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (head.weight, getattr(head, "bias", None)) if t is not None)


def head_weight_is_managed(head: nn.Module) -> bool:
    """True when a sharding wrapper materialises the head's weight only around the head's call."""
    if isinstance(head, _fsdp_module_class()):
        return True
    return any(is_dtensor(t) or is_zero3_partitioned(t) for t in _head_tensors(head))


def _under_fsdp2(model: nn.Module) -> bool:
    fsdp_module = _fsdp_module_class()
    return bool(fsdp_module) and any(isinstance(m, fsdp_module) for m in model.modules())


def sharded_head_reason(model: nn.Module, head: nn.Module) -> str:
    """Why a DTensor head weight can never be fused (``""`` when it can).

    An FSDP2 shard is fine: the unit's hooks gather it for the call. A DTensor in a model without
    any FSDP2 unit is a tensor-parallel (or otherwise distributed) weight that stays sharded.
    """
    if any(is_dtensor(t) for t in _head_tensors(head)) and not _under_fsdp2(model):
        return (
            "its head weight is a DTensor outside FSDP2 (tensor parallelism?); the fused loss needs "
            "the full weight, so the original sharded head runs"
        )
    return ""


def _check_full_weight(head: nn.Module) -> None:
    """Raise :class:`ShardedHeadError` if a head tensor is still sharded inside the head's call."""
    for name, tensor in (("weight", head.weight), ("bias", getattr(head, "bias", None))):
        if tensor is None:
            continue
        if is_dtensor(tensor):
            raise ShardedHeadError(
                f"liger_patch: lm_head.{name} is still a DTensor (placements {tuple(tensor.placements)}) "
                "inside lm_head's forward, so it is sharded by something other than FSDP2 (tensor "
                "parallelism?). The fused loss needs the full weight: keep lm_head replicated in the "
                "tensor-parallel plan, shard it with torch.distributed.fsdp.fully_shard only, or "
                "revert_liger(model) to use the original head."
            )
        if zero3_unavailable(tensor):
            raise ShardedHeadError(
                f"liger_patch: lm_head.{name} is partitioned by DeepSpeed ZeRO-3 and was not gathered "
                f"for lm_head's call (ds_status={tensor.ds_status}). The fused loss runs inside "
                "lm_head's call so that DeepSpeed's module hooks gather it: train the model through "
                "the DeepSpeed engine (deepspeed.initialize, accelerate or the HF Trainer), or use "
                "ZeRO stage 1/2 or FSDP2, or revert_liger(model) to use the original head."
            )


def _call_head_as_fused_loss(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, **loss_kwargs: Any
) -> Any:
    """``head(hidden)`` with the fused loss as the head's forward for this one call.

    The call has the original's exact form (one positional tensor), so every hook sees what it
    sees for ``lm_head(hidden)``: FSDP2 casts ``hidden`` to its ``param_dtype``, a hook that
    rewrites the inputs keeps working, and the labels and ``loss_kwargs`` (the options, a float
    ``num_items_in_batch`` tensor included) reach the op untouched, through the closure.
    """

    def fused_loss_forward(hidden_in: torch.Tensor) -> Any:
        _check_full_weight(head)
        return fused_loss(hidden_in, head.weight, labels, head.bias, **loss_kwargs)

    own = vars(head).get("forward")
    head.forward = fused_loss_forward
    try:
        return head(hidden)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def fused_head_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    *,
    options: LossOptions = DEFAULT_OPTIONS,
    num_items_in_batch: Any = None,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``fused_loss(hidden, head.weight, labels, head.bias, options=options, ...)``, sharding-aware.

    ``overrides`` are options set for this call only (the op applies them to ``options``). For a
    head whose weight FSDP2 or DeepSpeed ZeRO-3 manages (:func:`head_weight_is_managed`) the loss
    is computed inside ``head``'s own call, so the weight is gathered before it, the gradient is
    reduced after it, and the backward re-gathers it, exactly as for ``head(hidden)``. Any other
    head calls the op directly.
    """
    loss_kwargs = dict(options=options, num_items_in_batch=num_items_in_batch, **overrides)
    if not head_weight_is_managed(head):
        return fused_loss(hidden, head.weight, labels, head.bias, **loss_kwargs)
    return _call_head_as_fused_loss(head, hidden, labels, **loss_kwargs)
