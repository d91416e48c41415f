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

**Tensor parallelism** (transformers' ``tp_plan``, a DTensor ``ColwiseParallel`` head) shards
the weight over the vocabulary for good: it is a ``DTensor`` with one ``Shard(0)`` placement
(others ``Replicate``), inside the head's call too. :func:`vocab_shard` reads this rank's rows,
their offset and the process group from it, and the loss runs as the vocabulary-parallel op
(``ops/cross_entropy/vocab_parallel.py``) on the local rows, never calling the head (its
tensor-parallel forward would gather the logits). Under FSDP2 as well (a 2-D mesh) the head's
own call comes first, so that FSDP2 gathers its shard of the data-parallel dimension, and the
vocabulary-parallel op runs inside it.

A weight that is still sharded *inside* the head's forward in any other way (``Shard(1)``,
``Partial``, a ZeRO-3 model that was not wrapped by the DeepSpeed engine) raises an error saying
what to do, never a shape error from deep inside a kernel.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from liger_patch.ops.core.vocab_shard import VocabShard
from liger_patch.ops.cross_entropy.functional import fused_loss
from liger_patch.ops.cross_entropy.options import DEFAULT_OPTIONS, LossOptions
from liger_patch.ops.cross_entropy.vocab_parallel import vocab_parallel_loss
from liger_patch.patching.adapters import is_lora_head, low_rank_term

__all__ = [
    "HeadShard",
    "ShardedHeadError",
    "call_as_forward",
    "check_plain_hidden",
    "fused_head_loss",
    "gathered_tensors",
    "head_tensor",
    "head_weight_is_managed",
    "is_dtensor",
    "is_zero3_partitioned",
    "lora_sharding_reason",
    "sharded_head_reason",
    "vocab_shard",
    "vocab_shard_problem",
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


def head_tensor(head: nn.Module, name: str) -> Any:
    """``head.<name>`` (``None`` when it has none), read past any access hook on its parameters.

    Inside the DeepSpeed engine's forward, ZeRO-3's parameter dict answers a read of a parameter
    that is not gathered by gathering it there and then, synchronously, and registering it as an
    external parameter of the module running: from then on every forward gathers the whole head
    at its start and holds it to its end, an all-gather outside DeepSpeed's prefetch plan. The
    fused path reads the head's tensors before the head's call only for their identity and flags,
    so it reads the registered entry with ``dict.get``, which no subclass's ``__getitem__``
    intercepts; the head's own call gathers it as for ``lm_head(hidden)``.
    """
    params = vars(head).get("_parameters")
    if isinstance(params, dict) and name in params:
        return dict.get(params, name)
    return getattr(head, name, None)


def _head_tensors(head: nn.Module) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in (head_tensor(head, "weight"), head_tensor(head, "bias")) if t is not None)


def head_weight_is_managed(head: nn.Module) -> bool:
    """True when a sharding wrapper materialises the head's weight only around the head's call:
    the head is an FSDP2 module, or its tensors are ZeRO-3 partitions. (A tensor-parallel weight
    is never materialised: the loss runs on its shard, see :func:`vocab_shard`.)"""
    if isinstance(head, _fsdp_module_class()):
        return True
    return any(is_zero3_partitioned(t) for t in _head_tensors(head))


def _under_fsdp2(model: nn.Module) -> bool:
    fsdp_module = _fsdp_module_class()
    return bool(fsdp_module) and any(isinstance(m, fsdp_module) for m in model.modules())


@dataclass(frozen=True)
class HeadShard:
    """A vocabulary-sharded head as the loss needs it: this rank's rows of the weight and bias
    (plain tensors, through which gradients reach the DTensor parameters) and where they sit."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    shard: VocabShard


def _vocab_mesh_dim(tensor: Any) -> int | None:
    """The mesh dimension that shards a DTensor over its dim 0 alone (every other placement
    ``Replicate``), else ``None``."""
    placements = tuple(tensor.placements)
    vocab_dims = [i for i, p in enumerate(placements) if p.is_shard() and p.dim % tensor.ndim == 0]
    others_replicated = all(p.is_replicate() for i, p in enumerate(placements) if i not in vocab_dims)
    return vocab_dims[0] if len(vocab_dims) == 1 and others_replicated else None


def vocab_shard_problem(head: nn.Module) -> str:
    """Why the head's DTensor weight (and bias) is not a vocabulary shard the fused loss can use,
    ``""`` when it is one (or is not a DTensor)."""
    weight, bias = head_tensor(head, "weight"), head_tensor(head, "bias")
    if not is_dtensor(weight):
        return f"its head bias is a DTensor (placements {tuple(bias.placements)})" if is_dtensor(bias) else ""
    dim = _vocab_mesh_dim(weight)
    if dim is None:
        return (
            f"its head weight is a DTensor with placements {tuple(weight.placements)}, not sharded over "
            "the vocabulary alone (one Shard(0), the rest Replicate)"
        )
    if bias is not None and not (
        is_dtensor(bias) and bias.device_mesh == weight.device_mesh and _vocab_mesh_dim(bias) == dim
    ):
        return "its head bias is not sharded over the vocabulary like its weight"
    return ""


def vocab_shard(head: nn.Module) -> HeadShard | None:
    """This rank's part of a head sharded over the vocabulary (a tensor-parallel ``ColwiseParallel``
    head: a DTensor weight with one ``Shard(0)`` placement), ``None`` for a plain weight.

    The offset comes from the DTensor itself (``torch.chunk``'s split: with V not divisible by the
    group, the last ranks hold fewer rows), the group from the mesh dimension that shards it.
    Raises :class:`ShardedHeadError` for a DTensor sharded in any other way.
    """
    if not (is_dtensor(head_tensor(head, "weight")) or is_dtensor(head_tensor(head, "bias"))):
        return None
    problem = vocab_shard_problem(head)
    if problem:
        raise ShardedHeadError(
            f"liger_patch: {problem}, so the fused loss cannot use it. Shard lm_head column-wise (over "
            "the vocabulary, as transformers' tp_plan does), or keep it replicated, or revert_liger(model) "
            "to use the original head."
        )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    weight, bias = head.weight, head.bias
    dim = _vocab_mesh_dim(weight)
    _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
    shard = VocabShard(offset=offset[0], vocab=weight.shape[0], group=weight.device_mesh.get_group(dim))
    return HeadShard(weight.to_local(), None if bias is None else bias.to_local(), shard)


def sharded_head_reason(model: nn.Module, head: nn.Module) -> str:
    """Why a DTensor head weight can never be fused (``""`` when it can).

    An FSDP2 shard is fine: the unit's hooks gather it for the call (and a tensor-parallel shard
    inside it is checked there). Outside FSDP2, a DTensor head is a tensor-parallel one: fine when
    it is sharded over the vocabulary (:func:`vocab_shard_problem`).
    """
    problem = vocab_shard_problem(head)  # "" for a plain head: no walk over the model's modules
    if not problem or _under_fsdp2(model):
        return ""
    return f"{problem}; the original sharded head runs"


def lora_sharding_reason(model: nn.Module, lora: nn.Module, base: nn.Module) -> str:
    """Why a LoRA head cannot be fused because of how its weights are sharded (``""`` when they
    are not): the op would need its low-rank factors gathered with the base weight inside the head's
    call (FSDP2 unit, ZeRO-3) or sharded with it over the vocabulary (tensor parallelism)."""
    tensors = (head_tensor(base, "weight"), *(p for _, p in lora.named_parameters()))
    if is_dtensor(tensors[0]) and not _under_fsdp2(model):
        return "it is a LoRA layer on a tensor-parallel head (no vocabulary-parallel low-rank term)"
    if (
        head_weight_is_managed(base)
        or isinstance(lora, _fsdp_module_class())
        or any(map(is_zero3_partitioned, tensors))
    ):
        return "it is a LoRA layer on a head whose weights FSDP2 (as its own unit) or ZeRO-3 gathers per call"
    return ""


def gathered_tensors(head: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias, whole: read inside the head's call for a head whose weight a
    wrapper manages. Raises :class:`ShardedHeadError` if a ZeRO-3 tensor was not gathered."""
    weight, bias = head.weight, getattr(head, "bias", None)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and zero3_unavailable(tensor):
            raise ShardedHeadError(
                f"liger_patch: lm_head.{name} is partitioned by DeepSpeed ZeRO-3 and was not gathered "
                f"for lm_head's call (ds_status={tensor.ds_status}). The fused loss runs inside "
                "lm_head's call so that DeepSpeed's module hooks gather it: train the model through "
                "the DeepSpeed engine (deepspeed.initialize, accelerate or the HF Trainer), or use "
                "ZeRO stage 1/2 or FSDP2, or revert_liger(model) to use the original head."
            )
    return weight, bias


def check_plain_hidden(hidden: torch.Tensor) -> None:
    """Raise :class:`ShardedHeadError` for hidden states that are a DTensor: a tensor-parallel head's
    loss takes them as plain tensors, the same on every rank of its group."""
    if is_dtensor(hidden):
        raise ShardedHeadError(
            f"liger_patch: the hidden states reaching the tensor-parallel lm_head are a DTensor (placements "
            f"{tuple(hidden.placements)}); the fused loss takes them as plain tensors, the same on every "
            "rank of the group, as transformers' tp_plan passes them (use_local_output=True in a torch "
            "parallelize_module plan), or revert_liger(model) to use the original head."
        )


def _with_extra_bias(
    bias: torch.Tensor | None, weight: torch.Tensor, extra: torch.Tensor | None
) -> torch.Tensor | None:
    """The head's bias plus a constant the forward adds to its logits (``extra``, rows matching
    ``weight``'s), in the weight's dtype; the head's bias alone without one."""
    if extra is None:
        return bias
    extra = extra.to(device=weight.device, dtype=weight.dtype)
    return extra if bias is None else bias + extra


def _op_on_head_tensors(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    extra_bias: torch.Tensor | None = None,
    **loss_kwargs: Any,
):
    """The op on the head's tensors as they are now (with ``extra_bias`` added to the head's bias):
    whole (``fused_loss``), or this rank's vocabulary shard (``vocab_parallel_loss``)."""
    found = vocab_shard(head)
    if found is None:
        weight, bias = gathered_tensors(head)
        return fused_loss(hidden, weight, labels, _with_extra_bias(bias, weight, extra_bias), **loss_kwargs)
    check_plain_hidden(hidden)
    if extra_bias is not None:
        rows = found.shard.offset + torch.arange(found.weight.shape[0], device=extra_bias.device)
        extra_bias = extra_bias[rows]
    bias = _with_extra_bias(found.bias, found.weight, extra_bias)
    return vocab_parallel_loss(hidden, found.weight, labels, bias, shard=found.shard, **loss_kwargs)


def call_as_forward(head: nn.Module, hidden: torch.Tensor, compute: Callable[[torch.Tensor], Any]) -> Any:
    """``head(hidden)`` with ``compute`` as the head's forward for this one call: its result is the call's.

    The call has the original's exact form (one positional tensor), so every hook sees what it
    sees for ``lm_head(hidden)``: FSDP2 gathers the weight before it (casting ``hidden`` to its
    ``param_dtype``), registers the re-gathering for backward on the tensors ``compute`` returns and
    reduce-scatters the gradient after; DeepSpeed ZeRO-3's module hooks do the same. A hook that
    rewrites the inputs keeps working, and whatever else ``compute`` needs (labels, options, a
    float ``num_items_in_batch`` tensor) reaches it untouched, bound to it. A forward that
    transformers' tensor parallelism put on the instance is set aside for the call.
    """
    own = vars(head).get("forward")
    head.forward = compute
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
    extra_bias: torch.Tensor | None = None,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``fused_loss(hidden, head.weight, labels, head.bias, options=options, ...)``, sharding-aware;
    ``extra_bias`` (``(V,)``, a constant the forward adds to the logits: BART's
    ``final_logits_bias``) is added to the head's bias.

    ``overrides`` are options set for this call only (the op applies them to ``options``). For a
    head whose weight FSDP2 or DeepSpeed ZeRO-3 manages (:func:`head_weight_is_managed`) the loss
    is computed inside ``head``'s own call, so the weight is gathered before it, the gradient is
    reduced after it, and the backward re-gathers it, exactly as for ``head(hidden)``. A head
    sharded over the vocabulary (tensor parallelism) gets the vocabulary-parallel op on its
    local rows; any other head calls the op directly. A PEFT LoRA head (``adapters.py``) runs
    the op on its base layer with its active adapters as the low-rank term.
    """
    loss_kwargs = dict(
        options=options, num_items_in_batch=num_items_in_batch, extra_bias=extra_bias, **overrides
    )
    if is_lora_head(head):
        term = low_rank_term(head, hidden)
        head = head.get_base_layer()
        if term is not None:
            loss_kwargs["low_rank"] = term
    compute = functools.partial(_op_on_head_tensors, head, labels=labels, **loss_kwargs)
    return call_as_forward(head, hidden, compute) if head_weight_is_managed(head) else compute(hidden)
