"""The state every pass of one ``chunks.run_chunks`` call reads (``PassState``): the call, its
plan and buffers, the GEMMs' operands, and the walked rows' coefficients and records."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_patch.ops.core import head_start
from liger_patch.ops.core.budget import ChunkPlan
from liger_patch.ops.core.gemm import LogitsGemm, gemm_dtype_for
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.grad_weight_layout import grad_weight_buffers, weight_operand
from liger_patch.ops.core.walked_rows import Chunk, walked
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, ChunkResult
from liger_patch.ops.cross_entropy.chunk_plan import fused_backend, plan_for
from liger_patch.ops.cross_entropy.low_rank import LowRank
from liger_patch.ops.cross_entropy.row_io import GivenLse, RowGrad, RowRecords


@dataclass(frozen=True)
class PassState:
    """What the passes of one ``run_chunks`` call read: the same for every chunk and block.

    ``gemm`` computes the chunks' logits (the weight as the GEMMs read it, ``weight_operand``; the
    fp32 bias; the fused GEMM token chunks may use, ``chunk_plan.fused_backend``), ``res`` holds
    the results the passes fill and ``grads`` where the token chunks add up their gradients (grad_W
    in ``res.grad_weight`` itself or in a sum of another dtype). ``token_grads``: whether the token
    chunks compute gradients (their row kernel writes d(loss)/d(logits) and grad_h follows).
    ``labels``, ``coef_ce``, ``coef_z`` and ``lse_in`` have one row per walked row (``rows.index``'s
    rows, gathered once, when the pass skips rows)."""

    call: ChunkCall
    plan: ChunkPlan
    gemm: LogitsGemm
    labels: torch.Tensor
    coef_ce: torch.Tensor | None
    coef_z: torch.Tensor | None
    lse_in: torch.Tensor | None
    rows: RowRecords
    res: ChunkResult
    grads: GradSums
    token_grads: bool
    low_rank: LowRank | None = None
    head: head_start.HeadStart | None = None  # the first chunk's logits, begun before the call

    def grad_of(self, chunk: Chunk, g: torch.Tensor | None) -> RowGrad | None:
        """The row kernel's gradient record for ``chunk``'s rows, writing into ``g``."""
        return None if g is None else RowGrad(g, chunk.rows(self.coef_ce), chunk.rows(self.coef_z))

    def given_of(self, chunk: Chunk) -> GivenLse | None:
        """The given log-sum-exp of ``chunk``'s rows, if any."""
        return None if self.lse_in is None else GivenLse(chunk.rows(self.lse_in))


def _new_result(call: ChunkCall, skips_rows: bool) -> ChunkResult:
    """The result's buffers: grad_h, grad_b's fp32 sum, and ce and lse where the token pass
    scatters its walked rows into them (``skips_rows``: the others must read as ignored ones, so
    the per-row buffers start as zeros) or has no rows; else the token chunks' own ce and lse
    become the result (``chunks._set_losses``), and allocating them here would be two launches
    for nothing. grad_W is ``grad_weight_buffers``'."""
    new = torch.zeros if skips_rows else torch.empty
    hidden, grads = call.inputs.hidden, call.computes_grads
    n_rows, device = hidden.shape[0], hidden.device
    res = ChunkResult(None, None, None, None, None)
    if call.lse_in is None and (skips_rows or n_rows == 0):
        res.ce = new(n_rows, dtype=torch.float32, device=device)
        res.lse = new(n_rows, dtype=torch.float32, device=device)
    if grads and call.wanted.hidden:  # contiguous whatever hidden's strides (not empty_like)
        res.grad_hidden = new(hidden.shape, dtype=hidden.dtype, device=device)
    if grads and call.wanted.bias and call.inputs.bias is not None:
        res.grad_bias = torch.zeros(call.inputs.weight.shape[0], dtype=torch.float32, device=device)
    return res


def pass_state(call: ChunkCall) -> tuple[PassState, torch.Tensor | None]:
    """The passes' state for ``call`` (its plan, buffers and GEMM operands) and the grad_W sum
    when it is kept apart from ``res.grad_weight`` (``grad_weight_buffers``)."""
    hidden, weight, bias = call.inputs.hidden, call.inputs.weight, call.inputs.bias
    grad_weight_here = call.computes_grads and call.wanted.weight
    plan, row_index = plan_for(call, grad_weight_here, call.row_index)
    wanted_term = (call.computes_grads and call.wanted.u, call.computes_grads and call.wanted.b)
    term = LowRank.of(call.low_rank, gemm_dtype_for(hidden), wanted_term, row_index is not None)
    fused = fused_backend(call)
    walking = hidden.shape[0] if row_index is None else row_index.shape[0]
    head = call.head_start
    if head is not None and (
        fused is None or plan.two_pass or not head.fits(row_index is not None, min(plan.rows, walking))
    ):
        head = None
    res = _new_result(call, skips_rows=row_index is not None)
    grad_sum = None
    if grad_weight_here:
        res.grad_weight, grad_sum = grad_weight_buffers(plan, weight, hidden.dtype)
    copy_home = res.grad_weight if plan.weight_in_grad_weight else None
    w = weight_operand(weight, hidden.dtype, gemm_dtype_for(hidden), copy_home)
    b = None if bias is None else bias.float().contiguous()  # the fused GEMM reads it by column
    state = PassState(
        call=call,
        plan=plan,
        gemm=LogitsGemm(w, b, call.opts, call.logits_dtype, fused),
        labels=walked(call.labels, row_index),
        coef_ce=walked(call.coef_ce, row_index),
        coef_z=walked(call.coef_z, row_index),
        lse_in=walked(call.lse_in, row_index),
        rows=RowRecords.walking(call.class_weight, call.outputs, call.entropy_grad, row_index),
        res=res,
        grads=GradSums(
            res.grad_hidden,
            res.grad_weight if grad_sum is None else grad_sum,
            res.grad_bias,
            plan.overwrite_first,
        ),
        token_grads=call.computes_grads
        and (call.wanted.hidden or call.wanted.u or call.wanted.b or not plan.two_pass),
        low_rank=term,
        head=head,
    )
    return state, grad_sum
