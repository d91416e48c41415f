"""Executes a chunk plan (``budget.plan_chunks``) with a backend: GEMMs around one row kernel per chunk.

Token chunks (the default). For each chunk of rows: ``logits = h W^T + b`` (the only
``rows x V`` buffer), the backend's row kernel turns it into loss terms and, in place, into
d(loss)/d(logits); then ``grad_h = g W`` (written straight into its slice) and ``grad_W += g^T h``.
Three GEMMs per token, but grad_W is read and written once per chunk, which a small memory
budget (few rows per chunk) makes expensive.

Two passes (small budgets, see ``Tuning.min_token_chunk_rows``). Pass A runs the token chunks for the
loss and grad_h only, with the not-yet-computed grad_W as its logits buffer; pass B
(``vocab_pass``) walks the vocabulary in blocks, recomputes the ``tokens x block`` logits and
writes each grad_W block with one GEMM over all tokens. Four GEMMs per token instead of three,
but no grad_W re-reads and no working memory beyond the budget.

On the token-chunk path grad_W sums one GEMM per chunk, each accumulating in fp32; across chunks
the sum is kept in fp32 or in the hidden states' dtype, as the plan says. The GEMMs run in the
hidden states' dtype (fp32 on the CPU). A wider weight (an fp32 one under bf16 autocast, which
casts only the hidden states) is rounded to it as autocast would round it; the copy that takes
lives in grad_W's bytes when the plan allows (``ChunkPlan.weight_in_grad_weight``), so the op
needs no memory for it.

The GEMMs and their dtypes are ``gemm``'s; where grad_W is summed and what borrows its bytes,
``grad_weight_layout``'s. The full ``tokens x V`` logits never exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_patch.ops.core import head_start
from liger_patch.ops.core.contexts import without_grad
from liger_patch.ops.core.gemm import grad_view
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.grad_weight_layout import (
    buffer_in,
    widen_in_place,
)
from liger_patch.ops.core.walked_rows import Chunk
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, ChunkResult
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.pass_state import PassState, pass_state
from liger_patch.ops.cross_entropy.row_io import NO_RECORDS, ChunkRecords, GivenLse, RowGrad
from liger_patch.ops.cross_entropy.vocab_pass import vocab_pass


@without_grad  # gradients are computed by hand here; autograd must not track the chunk GEMMs
def run_chunks(call: ChunkCall) -> ChunkResult:
    """Loss terms for every row of the call's hidden states (N, H), and the gradients it asks for
    in the dtypes of their inputs (``ChunkCall`` says what a call asks)."""
    state, grad_sum = pass_state(call)
    res, plan, term = state.res, state.plan, state.low_rank
    # With the log-sum-exp given and no gradient wanted from token chunks, pass A has no work.
    if call.lse_in is None or state.token_grads:
        _token_pass(state)
    state.rows.finish()
    if plan.two_pass:
        vocab_pass(state)
    # The state holds the weight's copy: drop it before grad_W is made (its own tensor), or
    # before the widening overwrites it (in grad_W's second half).
    del state
    if grad_sum is not None and plan.weight_in_grad_weight:
        widen_in_place(res.grad_weight, grad_sum.dtype)
    elif grad_sum is not None:
        res.grad_weight = grad_sum.to(call.inputs.weight.dtype)
    if res.grad_bias is not None:
        res.grad_bias = res.grad_bias.to(call.inputs.bias.dtype)
    if term is not None:
        res.grad_u, res.grad_b = term.results()
    return res


@dataclass
class ChunkLogits:
    """A token chunk's logits and the fused GEMM's log-sum-exp partials (``None`` from cuBLAS).
    ``token_chunk`` takes the partials out for its row kernel, so that nothing holds them through
    the chunk's gradient GEMMs (docs/perf-notes.md item 21)."""

    logits: torch.Tensor
    partials: tuple | None

    def take_partials(self) -> tuple | None:
        """The partials, no longer held here."""
        partials, self.partials = self.partials, None
        return partials


def _chunk_logits(
    state: PassState, chunk: Chunk, h: torch.Tensor, scratch: torch.Tensor | None
) -> ChunkLogits:
    """The chunk's logits and partials: finished from the head start for the first chunk, else
    computed (into grad_W's bytes on the two-pass path: ``plan.logits_in_grad_weight``)."""
    gemm = state.gemm
    if state.head is not None and chunk.start == 0:
        return ChunkLogits(*head_start.finish(state.head, gemm, h))
    out = None if scratch is None else buffer_in(scratch, h.shape[0], gemm.w.shape[0], gemm.logits_dtype)
    return ChunkLogits(*gemm.logits(h, out))


def _token_pass(state: PassState) -> None:
    """Token chunks: logits, the row kernel, then grad_h into its rows and (one pass) grad_W += g^T h
    and grad_b, summed in ``state.grads``.

    On the two-pass path the chunks may live in grad_W's bytes (``plan.logits_in_grad_weight``),
    free until pass B writes it (its first half, when the weight's copy fills the second)."""
    res, w, call = state.res, state.gemm.w, state.call
    scratch = res.grad_weight if state.plan.logits_in_grad_weight else None
    ces, lses = [], []
    for chunk in state.rows.chunks(call.inputs.hidden.shape[0], state.plan.rows):
        h = chunk.take(call.inputs.hidden).to(w.dtype)
        made = _chunk_logits(state, chunk, h, scratch)
        logits = made.logits
        u = None if state.low_rank is None else state.low_rank.rows(chunk)
        if u is not None:
            state.low_rank.add_to(logits, u)
        g = grad_view(logits, w.dtype) if state.token_grads else None
        ce_c, lse_c = token_chunk(
            call.backend, call.opts, made, chunk.rows(state.labels), state.grad_of(chunk, g),
            None if g is None else state.grads, chunk, h, w,
            given=state.given_of(chunk), records=state.rows.for_chunk(chunk),
            weight_too=not state.plan.two_pass,
        )  # fmt: skip
        ces.append(ce_c)
        lses.append(lse_c)
        if g is None:
            continue
        if u is not None and state.low_rank.wants_grads:
            state.low_rank.chunk_grads(chunk, u, g)
        del made, logits, g
    if call.lse_in is None and ces:
        _set_losses(res, ces, lses, state.rows.index)


def token_chunk(
    backend: RowBackend,
    opts: LossOptions,
    made: ChunkLogits,
    labels: torch.Tensor,
    grad: RowGrad | None,
    grads: GradSums | None,
    chunk: Chunk,
    h: torch.Tensor,
    w: torch.Tensor,
    *,
    given: GivenLse | None = None,
    records: ChunkRecords = NO_RECORDS,
    weight_too: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token chunk once its logits (and the fused GEMM's partials) are ``made``: the row
    kernel, which gives the chunk's ce and lse and, where ``grad`` says, writes d(loss)/d(logits)
    into ``grad.out``; then that gradient's share of grad_h, grad_W and grad_b, added to
    ``grads`` (``GradSums.add``, with the hidden rows ``h`` and weight ``w`` as the GEMMs read
    them; nothing where ``grads`` or ``grad`` is ``None``). The partials are taken from ``made``
    for the row kernel and freed once it is launched, before the gradient GEMMs allocate. The
    body of the chunk loop and of a call plan (``one_chunk``): one home for both."""
    extra = {} if made.partials is None else {"partials": made.take_partials()}
    ce, lse = backend.row_kernel(made.logits, labels, opts, grad=grad, given=given, records=records, **extra)
    del extra  # the partials' last reference: the row kernel has read them
    if grads is not None and grad is not None:
        grads.add(chunk, grad.out, h, w, weight_too=weight_too)
    return ce, lse


def _set_losses(res: ChunkResult, ces: list, lses: list, index: torch.Tensor | None) -> None:
    """The token chunks' ce and lse into the result: one copy (or scatter of the walked rows
    into the result's zeros) per call rather than one per chunk, and none for a single chunk of
    every row, whose own ce and lse become the result's."""
    for name, parts in (("ce", ces), ("lse", lses)):
        walked_rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if index is not None:
            getattr(res, name).index_copy_(0, index, walked_rows)
        else:
            setattr(res, name, walked_rows)
