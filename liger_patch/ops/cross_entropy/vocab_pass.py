"""Pass B of the two-pass path (``chunks``): grad_W (and grad_b) block by block over the
vocabulary, from recomputed logits, with one GEMM over all tokens per block."""

from __future__ import annotations

import torch

from liger_patch.ops.core.gemm import gemm_logits, grad_view, mm_into
from liger_patch.ops.core.grad_weight_layout import buffer_in
from liger_patch.ops.cross_entropy.pass_state import PassState
from liger_patch.ops.cross_entropy.row_io import ChunkRecords, GivenLse, RowGrad


def _coefs(state: PassState) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' coefficients as pass A's kernel applied them: times the token scale when token
    scaling gave one (pass A's kernel scaled its own rows)."""
    coef_ce, coef_z = state.coef_ce, state.coef_z
    token_scale = None if state.rows.outputs is None else state.rows.outputs.token_scale
    if token_scale is not None and coef_ce is not None:
        coef_ce, coef_z = coef_ce * token_scale, coef_z * token_scale
    return coef_ce, coef_z


def vocab_pass(state: PassState) -> None:
    """The row kernel turns each block's ``tokens x cols`` logits into the gradient using the full
    rows' log-sum-exp (the given one, else pass A's), and one GEMM over all tokens writes that
    block of grad_W. Blocks marked ``in_grad_weight`` keep their logits in grad_W's still
    unwritten last rows; the others share one buffer sized by the budget."""
    res, call, gemm = state.res, state.call, state.gemm
    dtype, b = gemm.logits_dtype, gemm.b
    coef_ce, coef_z = _coefs(state)
    lse = state.lse_in if state.lse_in is not None else res.lse
    h, w = call.inputs.hidden.to(gemm.w.dtype), gemm.w
    u = None if state.low_rank is None else state.low_rank.rows(None)
    n_rows, vocab = h.shape[0], w.shape[0]
    records = ChunkRecords(class_weight=state.rows.class_weight, entropy_grad=state.rows.entropy_grad)
    buf = None
    for v0, v1, in_grad_weight in state.plan.vocab_blocks:
        if in_grad_weight:
            out = buffer_in(res.grad_weight, n_rows, v1 - v0, dtype, at_end=True)
        else:
            if buf is None:
                buf = torch.empty(n_rows * (v1 - v0), dtype=dtype, device=h.device)
            out = buf[: n_rows * (v1 - v0)].view(n_rows, v1 - v0)
        logits = gemm_logits(h, w[v0:v1], None if b is None else b[v0:v1], dtype, out=out)
        if u is not None:
            state.low_rank.add_to(logits, u, slice(v0, v1))
        g = grad_view(logits, h.dtype)
        call.backend.row_kernel(
            logits,
            state.labels,
            call.opts,
            grad=RowGrad(g, coef_ce, coef_z),
            given=GivenLse(lse, v0, vocab),
            records=records,
        )
        mm_into(res.grad_weight[v0:v1], g.t(), h)  # one GEMM over all tokens, rounded once
        if res.grad_bias is not None:
            res.grad_bias[v0:v1] += g.sum(dim=0, dtype=torch.float32)
        del logits, g, out
