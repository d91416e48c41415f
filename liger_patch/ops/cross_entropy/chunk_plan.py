"""The plan of a call of the chunk loops (``budget.plan_chunks`` for its sizes), and the first
token chunk's logits begun before the forward's label check is waited for (``start_head``)."""

from __future__ import annotations

import dataclasses

import torch

from liger_patch.ops.core import head_start
from liger_patch.ops.core.budget import ChunkPlan, ChunkShape, plan_chunks
from liger_patch.ops.core.contexts import autocast_off, without_grad
from liger_patch.ops.core.gemm import LogitsGemm, gemm_dtype_for
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall


def fused_backend(call: ChunkCall) -> RowBackend | None:
    """The backend whose fused logits GEMM the call's token chunks may use: its own, unless it has
    none, the tuning turns it off, the log-sum-exp is given (partials would save nothing and
    cuBLAS alone is faster) or partials cannot serve the call (``ChunkCall.no_partials``)."""
    backend = call.backend
    usable = backend.fused_logits is not None and call.opts.tuning.fused_logits
    return backend if usable and call.lse_in is None and not call.no_partials else None


def plan_for(
    call: ChunkCall, grad_weight: bool, row_index: torch.Tensor | None
) -> tuple[ChunkPlan, torch.Tensor | None]:
    """The call's chunk plan when it computes grad_W (``grad_weight``) or not, and ``row_index``
    if the token pass may walk only those rows (not on the two-pass path, whose pass B needs
    every row's hidden states in one tensor)."""
    hidden, weight, opts = call.inputs.hidden, call.inputs.weight, call.opts
    fused = fused_backend(call)
    shape = ChunkShape(
        n_rows=hidden.shape[0],
        vocab=weight.shape[0],
        weight_numel=weight.numel(),
        weight_bytes=weight.element_size(),
        logit_bytes=call.logits_dtype.itemsize,
        gemm_fp32=gemm_dtype_for(hidden) == torch.float32,
        operand_bytes=hidden.element_size(),
        partial_bytes_per_row=fused.fused_logits.partial_bytes_per_row(weight.shape[0], opts) if fused else 0,
        grad_weight=grad_weight,
    )
    if row_index is not None:
        gathered = dataclasses.replace(
            shape,
            n_rows=row_index.shape[0],
            gather_bytes_per_row=2 * hidden.shape[1] * gemm_dtype_for(hidden).itemsize,
        )
        plan = plan_chunks(gathered, call.budget_bytes, opts.tuning)
        if not plan.two_pass:
            return plan, row_index
    return plan_chunks(shape, call.budget_bytes, opts.tuning), None


@without_grad
def start_head(call: ChunkCall, grad_weight: bool, keep: torch.Tensor) -> head_start.HeadStart | None:
    """``head_start.start`` for the forward ``call`` (computing grad_W or not: ``grad_weight``),
    walking the rows of its hidden states that ``keep`` (the kept rows' mask) keeps:
    its plan and GEMM operands. ``None`` where that call's first chunk would not come from the
    fused GEMM (two passes, cuBLAS logits) or the weight needs a cast first."""
    hidden, weight, bias = call.inputs.hidden, call.inputs.weight, call.inputs.bias
    if weight.dtype != hidden.dtype or gemm_dtype_for(hidden) != hidden.dtype or hidden.shape[0] == 0:
        return None
    # ``keep`` stands in for the kept rows' index, whose length is not known yet: the first
    # chunk has at most the rows the budget holds unrounded (what a plan of one walked row gets:
    # ``budget.chunk_rows``).
    plan, walked = plan_for(call, grad_weight, keep)
    fused = fused_backend(call)
    if fused is None or plan.two_pass or plan.weight_in_grad_weight or walked is None:
        return None
    first = plan_for(call, grad_weight, keep[:1])[0].rows
    b = None if bias is None else bias.float().contiguous()
    gemm = LogitsGemm(weight, b, call.opts, call.logits_dtype, fused)
    with autocast_off(hidden.device.type):
        return head_start.start(gemm, hidden, min(first, hidden.shape[0]), keep)
