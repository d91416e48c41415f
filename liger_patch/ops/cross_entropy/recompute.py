"""``liger_patch::flce_backward``: the fused loss's gradients from recomputed logits.

The backward of ``liger_patch::flce`` (``operator.py``) where its forward did not compute the
gradients (reduction "none", fp16, a gradient through ``z_loss`` or the entropy, a second
backward): the logits are recomputed chunk by chunk with each row's log-sum-exp from the forward
and exact per-row coefficients. ``recompute_grads`` is also the vocabulary-parallel loss's
backward. Apart from ``operator.py`` so that the autograd formula (``autograd.py``), which
``operator.py`` registers, can call it without an import cycle.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from liger_patch.ops.core import budget
from liger_patch.ops.core.contexts import autocast_off, on_inputs_device
from liger_patch.ops.core.eager_call import EagerOp
from liger_patch.ops.core.kept_rows import in_range_unless_read
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, ChunkResult, GradsWanted, HeadInputs
from liger_patch.ops.cross_entropy.chunks import run_chunks
from liger_patch.ops.cross_entropy.forward_io import low_rank_needs
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ClassWeight, EntropyGrad

_F32 = torch.float32


def budget_bytes(call: ChunkCall, kept: Tensor | None) -> int:
    """The chunk buffers' bytes for the call walking ``kept`` rows (every row when ``None``): its
    budget (``budget.working_bytes``), which ``"batch"`` sizes by its hidden states and by what one
    chunk of those rows would take."""
    hidden, weight, n_tokens = call.inputs.hidden, call.inputs.weight, call.labels.shape[0]
    n_rows = n_tokens if kept is None else kept.shape[0]
    whole = budget.one_chunk_bytes(
        n_rows, n_tokens, weight.shape[0], call.logits_dtype.itemsize, hidden.shape[1], hidden.element_size()
    )
    return budget.working_bytes(call.opts.memory_budget, n_tokens, hidden.nbytes, whole)


@on_inputs_device
def _flce_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    class_weight: Tensor | None,
    lse: Tensor,
    coef_ce: Tensor,
    coef_z: Tensor,
    entropy_coef: Tensor | None,
    entropy: Tensor | None,
    options: str,
    needs: list[bool],
    low_rank_u: Tensor | None = None,
    low_rank_b: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of hidden, weight, bias, u and B (empty where not needed) from recomputed
    logits, with per-row coefficients of d ce, d z-loss and (``entropy_coef``) d entropy."""
    opts = LossOptions.from_key(options)
    call = ChunkCall(
        backend=row_backend(opts.backend, hidden.device),
        inputs=HeadInputs(hidden, weight, bias),
        labels=in_range_unless_read(labels.long().contiguous(), weight.shape[0], opts.ignore_index),
        opts=opts,
        budget_bytes=0,
        coef_ce=coef_ce,
        coef_z=coef_z,
        lse_in=lse,
        wanted=GradsWanted.of([*needs[:3], *low_rank_needs(needs)]),
        class_weight=ClassWeight.of(class_weight),
        entropy_grad=None if entropy_coef is None else EntropyGrad(entropy_coef.float(), entropy),
        low_rank=None if low_rank_u is None else (low_rank_u, low_rank_b),
    )
    res = recompute_grads(call)
    grads = (res.grad_hidden, res.grad_weight, res.grad_bias, res.grad_u, res.grad_b)
    return tuple(g if g is not None else torch.empty(0, dtype=_F32, device=hidden.device) for g in grads)


def recompute_grads(call: ChunkCall) -> ChunkResult:
    """The gradients ``call`` asks for, from logits recomputed with the rows' log-sum-exp
    (``call.lse_in``) and per-row coefficients of d ce, d z-loss and d entropy, within the call's
    memory budget for every row: the backward of ``flce`` and of the vocabulary-parallel loss
    (whose backend reads a shard's columns of wider rows)."""
    call = dataclasses.replace(call, budget_bytes=budget_bytes(call, None))
    with autocast_off(call.inputs.hidden.device.type):
        return run_chunks(call)


flce_backward = torch.library.custom_op("liger_patch::flce_backward", _flce_backward, mutates_args=())


@flce_backward.register_fake
def _flce_backward_fake(
    hidden,
    weight,
    bias,
    labels,
    class_weight,
    lse,
    coef_ce,
    coef_z,
    entropy_coef,
    entropy,
    options,
    needs,
    low_rank_u=None,
    low_rank_b=None,
):
    return tuple(
        t.new_empty(t.shape) if t is not None and need else hidden.new_empty(0, dtype=_F32)
        for t, need in zip(
            (hidden, weight, bias, low_rank_u, low_rank_b), (*needs[:3], *low_rank_needs(needs)), strict=True
        )
    )


FLCE_BACKWARD = EagerOp(torch.ops.liger_patch.flce_backward, _flce_backward)
"""``liger_patch::flce_backward``, or its implementation where the call is plain eager."""
