"""Executes a chunk plan (``budget.plan_chunks``) with a backend: GEMMs around one row kernel per chunk.

Token chunks (the default). For each chunk of rows: ``logits = h W^T + b`` (the only
``rows x V`` buffer), the backend's row kernel turns it into loss terms and, in place, into
d(loss)/d(logits); then ``grad_h = g W`` (written straight into its slice) and ``grad_W += g^T h``.
Three GEMMs per token, but grad_W is read and written once per chunk, which a small memory
budget (few rows per chunk) makes expensive.

Two passes (small budgets, see ``Tuning.min_token_chunk_rows``). Pass A runs the token chunks for the
loss and grad_h only, with the not-yet-computed grad_W as its logits buffer; pass B walks the
vocabulary in blocks, recomputes the ``tokens x block`` logits and writes each grad_W block with one
GEMM over all tokens. Four GEMMs per token instead of three, but no grad_W re-reads and no
working memory beyond the budget.

The GEMMs and their dtypes are ``gemm``'s; where grad_W is summed and what borrows its bytes,
``grad_weight_layout``'s. The full ``tokens x V`` logits never exist.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from liger_patch.ops.core import head_start
from liger_patch.ops.core.backends import Backend
from liger_patch.ops.core.budget import ChunkPlan, ChunkShape, plan_chunks
from liger_patch.ops.core.gemm import chunk_logits, gemm_dtype_for, gemm_logits, grad_view, mm_into
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.grad_weight_layout import (
    buffer_in,
    grad_weight_buffers,
    weight_operand,
    widen_in_place,
)
from liger_patch.ops.core.walked_rows import Chunk, walked
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.low_rank import LowRank
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ClassWeight, EntropyGrad, RowOutputs, RowRecords


@dataclass
class ChunkResult:
    ce: torch.Tensor | None
    lse: torch.Tensor | None
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None
    grad_u: torch.Tensor | None = None  # the low-rank term's (``low_rank.LowRank``)
    grad_b: torch.Tensor | None = None


def _plan(
    backend: RowBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    opts: LossOptions,
    logits_dtype: torch.dtype,
    budget_bytes: int,
    grad_weight: bool,
    lse_given: bool,
    no_partials: bool,
    row_index: torch.Tensor | None,
) -> tuple[ChunkPlan, Backend | None, torch.Tensor | None]:
    """The chunk plan of this call, the backend whose fused logits GEMM token chunks may use
    (``None`` when the log-sum-exp is given: partials would save nothing, cuBLAS alone is faster;
    and with ``no_partials``: class weights with label smoothing, whose class-weighted logit sums
    the partials lack, or a low-rank term, which the GEMM's partials would not include),
    and ``row_index`` if the token pass may walk only those rows (not on the two-pass path,
    whose pass B needs every row's hidden states in one tensor)."""
    usable = backend.fused_logits is not None and opts.tuning.fused_logits
    fused = backend if usable and not lse_given and not no_partials else None
    shape = ChunkShape(
        n_rows=hidden.shape[0],
        vocab=weight.shape[0],
        weight_numel=weight.numel(),
        weight_bytes=weight.element_size(),
        logit_bytes=logits_dtype.itemsize,
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
        plan = plan_chunks(gathered, budget_bytes, opts.tuning)
        if not plan.two_pass:
            return plan, fused, row_index
    return plan_chunks(shape, budget_bytes, opts.tuning), fused, None


@torch.no_grad()
def start_head(
    backend: RowBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LossOptions,
    budget_bytes: int,
    grad_weight: bool,
    no_partials: bool,
    keep: torch.Tensor | None,
) -> head_start.HeadStart | None:
    """``head_start.start`` for a forward ``run_chunks`` call with these arguments (``no_partials``
    as ``_plan`` takes it) that walks every row of ``hidden``, or with ``keep`` (the kept rows'
    mask) the kept ones: its plan and GEMM operands. ``None`` where that call's first chunk would
    not come from the fused GEMM (two passes, cuBLAS logits) or the weight needs a cast first."""
    if weight.dtype != hidden.dtype or gemm_dtype_for(hidden) != hidden.dtype or hidden.shape[0] == 0:
        return None
    logits_dtype = opts.logits_dtype or hidden.dtype
    # ``keep`` stands in for the kept rows' index, whose length is not known yet: over every
    # row the first chunk is the plan's, over the kept ones it has at most the rows the budget
    # holds unrounded (what a plan of one walked row gets: ``budget.chunk_rows``).
    args = (backend, hidden, weight, opts, logits_dtype, budget_bytes, grad_weight, False, no_partials)
    plan, fused, walked = _plan(*args, keep)
    if fused is None or plan.two_pass or plan.weight_in_grad_weight or (keep is not None and walked is None):
        return None
    first = plan.rows if keep is None else _plan(*args, keep[:1])[0].rows
    b = None if bias is None else bias.float().contiguous()
    with torch.autocast(hidden.device.type, enabled=False):
        return head_start.start(
            hidden, weight, b, opts, logits_dtype, fused, min(first, hidden.shape[0]), keep
        )


@dataclass(frozen=True)
class _PassState:
    """What the passes of one ``run_chunks`` call read: the same for every chunk and block.

    ``fused`` is the backend whose fused logits GEMM token chunks may use (``_plan``), ``w`` the
    weight as the GEMMs read it (``weight_operand``), ``b`` the fp32 bias, ``res`` the results the
    passes fill, and ``grads`` where the token chunks add up their gradients (grad_W in
    ``res.grad_weight`` itself or in a sum of another dtype). ``token_grads``: whether the token
    chunks compute gradients (their row kernel writes d(loss)/d(logits) and grad_h follows).
    ``labels``, ``coef_ce``, ``coef_z`` and ``lse_in`` have one row per walked row (``rows.index``'s
    rows, gathered once, when the pass skips rows)."""

    backend: RowBackend
    fused: Backend | None
    plan: ChunkPlan
    opts: LossOptions
    logits_dtype: torch.dtype
    hidden: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
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

    def per_row(self, chunk: Chunk) -> dict:
        """The row kernel's per-row coefficients and given log-sum-exp for ``chunk``'s rows."""
        return {
            name: None if t is None else chunk.rows(t)
            for name, t in (("coef_ce", self.coef_ce), ("coef_z", self.coef_z), ("lse_in", self.lse_in))
        }


def _new_result(
    hidden: torch.Tensor, vocab: int, losses: bool, grad_hidden: bool, grad_bias: bool, skips_rows: bool
) -> ChunkResult:
    """The result's buffers: ce and lse (``losses``; ``_set_losses`` fills them), grad_h, and
    grad_b's fp32 sum; grad_W is ``grad_weight_buffers``'. Where the token pass skips rows
    (``skips_rows``) they must read as ignored ones, so the per-row buffers start as zeros."""
    new = torch.zeros if skips_rows else torch.empty
    n_rows, device = hidden.shape[0], hidden.device
    res = ChunkResult(None, None, None, None, None)
    if losses:
        res.ce = new(n_rows, dtype=torch.float32, device=device)
        res.lse = new(n_rows, dtype=torch.float32, device=device)
    if grad_hidden:  # contiguous whatever hidden's strides (not empty_like)
        res.grad_hidden = new(hidden.shape, dtype=hidden.dtype, device=device)
    if grad_bias:
        res.grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device)
    return res


@torch.no_grad()  # gradients are computed by hand here; autograd must not track the chunk GEMMs
def run_chunks(
    backend: RowBackend,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    opts: LossOptions,
    *,
    budget_bytes: int,
    coef_ce: torch.Tensor | None = None,
    coef_z: torch.Tensor | None = None,
    lse_in: torch.Tensor | None = None,
    need_hidden: bool = False,
    need_weight: bool = False,
    need_bias: bool = False,
    class_weight: ClassWeight | None = None,
    outputs: RowOutputs | None = None,
    entropy_grad: EntropyGrad | None = None,
    row_index: torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    need_low_rank: tuple[bool, bool] = (False, False),
    head: head_start.HeadStart | None = None,
) -> ChunkResult:
    """Loss terms for every row of ``hidden`` (N, H), and gradients when coefficients are given.

    ``coef_ce``/``coef_z`` (N,) fp32 weight each row's d ce/dz and d z-term/dz; they are zero at
    ignored rows. ``lse_in`` (N,) skips the log-sum-exp pass (the backward passes the forward's).
    Gradients come back in the dtypes of their inputs. ``budget_bytes`` bounds the working
    memory (the logits chunk, or the vocabulary block in pass B, plus an fp32 grad_W accumulator
    when the plan keeps one); ``opts.logits_dtype`` is how chunks are stored and ``opts.tuning``
    shapes the plan.

    On the token-chunk path grad_W sums one GEMM per chunk, each accumulating in fp32; across
    chunks the sum is kept in fp32 or in the hidden states' dtype, as the plan says.

    The GEMMs run in the hidden states' dtype (fp32 on the CPU). A wider weight (an fp32 one
    under bf16 autocast, which casts only the hidden states) is rounded to it as autocast would
    round it; the copy that takes lives in grad_W's bytes when the plan allows
    (``ChunkPlan.weight_in_grad_weight``), so the op needs no memory for it.

    ``class_weight``, ``outputs`` (N,)-long per-row results to fill, and ``entropy_grad`` are the
    row kernel's records (``row_io``), passed on chunk by chunk.

    ``row_index`` (sorted int64 row numbers) are the rows that count, when the others are all
    ignored rows (the forward passes the kept rows): the token chunks then gather those rows and
    skip the rest, whose ce, lse, grad_h and outputs are what an ignored row gets. Every GEMM
    shrinks by the share of ignored rows. Not on the two-pass path.

    ``low_rank`` ``(u, B)`` adds ``u B^T`` to the logits (``low_rank.py``); ``need_low_rank`` says
    whether u and B want gradients (``ChunkResult.grad_u`` / ``grad_b``).

    ``head``: ``start_head``'s first chunk for this call, used where the call walks every row with
    the plan it was started for, else dropped.
    """
    wanted = (need_hidden, need_weight, need_bias, *need_low_rank)
    compute_grad = coef_ce is not None and any(wanted)
    grad_weight_here = compute_grad and need_weight
    logits_dtype = opts.logits_dtype or hidden.dtype  # of the input, not of the (CPU: fp32) GEMMs
    weighted_smoothing = class_weight is not None and opts.label_smoothing != 0.0
    plan, fused, row_index = _plan(
        backend,
        hidden,
        weight,
        opts,
        logits_dtype,
        budget_bytes,
        grad_weight_here,
        lse_in is not None,
        weighted_smoothing or low_rank is not None,
        row_index,
    )
    term = LowRank.of(
        low_rank,
        gemm_dtype_for(hidden),
        tuple(compute_grad and n for n in need_low_rank),
        row_index is not None,
    )
    walking = hidden.shape[0] if row_index is None else row_index.shape[0]
    if head is not None and (
        fused is None or plan.two_pass or not head.fits(row_index is not None, min(plan.rows, walking))
    ):
        head = None
    rows = RowRecords.walking(class_weight, outputs, entropy_grad, row_index)
    res = _new_result(
        hidden,
        weight.shape[0],
        losses=lse_in is None,
        grad_hidden=compute_grad and need_hidden,
        grad_bias=compute_grad and need_bias,
        skips_rows=row_index is not None,
    )
    grad_sum = None
    if grad_weight_here:
        res.grad_weight, grad_sum = grad_weight_buffers(plan, weight, hidden.dtype)
    copy_home = res.grad_weight if plan.weight_in_grad_weight else None
    state = _PassState(
        backend=backend,
        fused=fused,
        plan=plan,
        opts=opts,
        logits_dtype=logits_dtype,
        hidden=hidden,
        w=weight_operand(weight, hidden.dtype, gemm_dtype_for(hidden), copy_home),
        b=None if bias is None else bias.float().contiguous(),  # the fused GEMM reads it by column
        labels=walked(labels, row_index),
        coef_ce=walked(coef_ce, row_index),
        coef_z=walked(coef_z, row_index),
        lse_in=walked(lse_in, row_index),
        rows=rows,
        res=res,
        grads=GradSums(
            res.grad_hidden,
            res.grad_weight if grad_sum is None else grad_sum,
            res.grad_bias,
            plan.overwrite_first,
        ),
        token_grads=compute_grad and (need_hidden or any(need_low_rank) or not plan.two_pass),
        low_rank=term,
        head=head,
    )
    # With the log-sum-exp given and no gradient wanted from token chunks, pass A has no work.
    if lse_in is None or state.token_grads:
        _token_pass(state)
    rows.finish()
    if plan.two_pass:
        _vocab_pass(state)

    # The state holds the weight's copy: drop it before grad_W is made (its own tensor), or
    # before the widening overwrites it (in grad_W's second half).
    del state
    if grad_sum is not None and plan.weight_in_grad_weight:
        widen_in_place(res.grad_weight, grad_sum.dtype)
    elif grad_sum is not None:
        res.grad_weight = grad_sum.to(weight.dtype)
    if res.grad_bias is not None:
        res.grad_bias = res.grad_bias.to(bias.dtype)
    if term is not None:
        res.grad_u, res.grad_b = term.results()
    return res


def _token_pass(state: _PassState) -> None:
    """Token chunks: logits, the row kernel, then grad_h into its slice and (one pass) grad_W += g^T h,
    summed in ``state.grads.weight``.

    On the two-pass path the chunks may live in grad_W's bytes (``plan.logits_in_grad_weight``),
    free until pass B writes it (its first half, when the weight's copy fills the second)."""
    res, w = state.res, state.w
    scratch = res.grad_weight if state.plan.logits_in_grad_weight else None
    ces, lses = [], []
    for chunk in state.rows.chunks(state.hidden.shape[0], state.plan.rows):
        h = chunk.take(state.hidden).to(w.dtype)
        if state.head is not None and chunk.start == 0:
            logits, partials = head_start.finish(
                state.head, h, w, state.b, state.opts, state.logits_dtype, state.fused
            )
        else:
            out = None if scratch is None else buffer_in(scratch, h.shape[0], w.shape[0], state.logits_dtype)
            logits, partials = chunk_logits(h, w, state.b, state.opts, state.logits_dtype, out, state.fused)
        u = None if state.low_rank is None else state.low_rank.rows(chunk)
        if u is not None:
            state.low_rank.add_to(logits, u)
        g = grad_view(logits, w.dtype) if state.token_grads else None
        ce_c, lse_c = state.backend.row_kernel(
            logits,
            chunk.rows(state.labels),
            state.opts,
            grad=g,
            **state.per_row(chunk),
            **state.rows.for_chunk(chunk),
            **({} if partials is None else {"partials": partials}),
        )
        del partials  # now, not when the next chunk's are already allocated
        ces.append(ce_c)
        lses.append(lse_c)
        if g is None:
            continue
        state.grads.add(chunk, g, h, w, weight_too=not state.plan.two_pass)
        if u is not None and state.low_rank.wants_grads:
            state.low_rank.chunk_grads(chunk, u, g)
        del logits, g
    if res.ce is not None and ces:
        _set_losses(res, ces, lses, state.rows.index)


def _set_losses(res: ChunkResult, ces: list, lses: list, index: torch.Tensor | None) -> None:
    """The token chunks' ce and lse into the result: one copy (or scatter of the walked rows)
    per call rather than one per chunk, and none for a single chunk of every row."""
    for name, parts in (("ce", ces), ("lse", lses)):
        walked = parts[0] if len(parts) == 1 else torch.cat(parts)
        if index is not None:
            getattr(res, name).index_copy_(0, index, walked)
        else:
            setattr(res, name, walked)


def _vocab_pass(state: _PassState) -> None:
    """Pass B: grad_W (and grad_b) block by block over the vocabulary, from recomputed logits.

    The row kernel turns each block's ``tokens x cols`` logits into the gradient using the full
    rows' log-sum-exp (the given one, else pass A's), and one GEMM over all tokens writes that
    block of grad_W. Blocks marked ``in_grad_weight`` keep their logits in grad_W's still
    unwritten last rows; the others share one buffer sized by the budget.
    """
    res, dtype, b = state.res, state.logits_dtype, state.b
    coef_ce, coef_z = state.coef_ce, state.coef_z
    token_scale = None if state.rows.outputs is None else state.rows.outputs.token_scale
    if token_scale is not None and coef_ce is not None:
        # pass A's kernel applied the token scale to its own rows
        coef_ce, coef_z = coef_ce * token_scale, coef_z * token_scale
    lse = state.lse_in if state.lse_in is not None else res.lse
    h, w = state.hidden.to(state.w.dtype), state.w
    u = None if state.low_rank is None else state.low_rank.rows(None)
    n_rows, vocab = h.shape[0], w.shape[0]
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
        state.backend.row_kernel(
            logits,
            state.labels,
            state.opts,
            grad=g,
            coef_ce=coef_ce,
            coef_z=coef_z,
            lse_in=lse,
            col_offset=v0,
            vocab_total=vocab,
            class_weight=state.rows.class_weight,
            entropy_grad=state.rows.entropy_grad,
        )
        mm_into(res.grad_weight[v0:v1], g.t(), h)  # one GEMM over all tokens, rounded once
        if res.grad_bias is not None:
            res.grad_bias[v0:v1] += g.sum(dim=0, dtype=torch.float32)
        del logits, g, out
