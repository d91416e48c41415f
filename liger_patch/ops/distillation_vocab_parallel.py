"""The fused distillation loss on heads sharded over the vocabulary (tensor parallelism), never
building ``tokens x V`` logits, nor ``tokens x V/tp``: only chunks within the memory budget.

Each rank of a process group holds rows ``[offset, offset + V_r)`` of the student's (V, H_s)
weight and of the teacher's (V, H_t) (the same rows: ``VocabShard``, as a ``ColwiseParallel``
head splits them), and the *same* hidden states and labels as the other ranks of its group. The
loss and the student's gradients are exactly ``fused_linear_distillation``'s on the whole heads
(docs/distillation.md has the math); the row math is ``distillation_rows``' own, its shard
functions taking what a row needs from every shard:

* forward, pass 1 (two logits GEMMs per kept token, in chunks): per row over the shard's columns,
  the log-sum-exp of the student's and the teacher's logits at the temperature (and with
  ``ce_weight``, of the student's final logits and its logit at the label when the label is in the
  shard); one all-gather; every rank combines them into the rows' (the same bits on every rank);
* forward, pass 2 (two more): with the rows' log-sum-exp the shard's log-probs are the rows' own
  at its columns, so it sums its part of the divergence per row (``shard_divergence_sums``: D, or
  KL(p_t || m) and KL(p_s || m)); one all-reduce gives the rows' sums and the loss
  ``(1 - w) D + w ce``;
* backward (four): both logits again, the gradient at the shard's columns from the rows' sums
  (``shard_distill_grad``: KL(p_s || p_t) or KL(p_s || m) is what beta > 0 subtracts), then grad_W
  and grad_b of the shard (complete) and the shard's part of grad_h, summed over the group (one
  all-reduce, as the unpatched tensor-parallel head does).

Eight GEMMs per kept token against the unsharded op's four: the divergence of a row needs its
log-sum-exp over every shard before any term can be summed, and its gradient the sums over every
shard, so no pass can do the next one's work while its chunk is hot. Collectives per call, the
same number whatever the chunking: the agreement all-reduce of ``vocab_parallel`` (the ranks agree
on the tokens and the gradients wanted before anything that could hang; one host sync), one
all-gather of 2 or 4 numbers per token, one all-reduce of 1 or 2, and the backward's grad_h.
The teacher's tensors get no gradient; the backward reads them again (saved, or kept as they are
when they are inference tensors). The PyTorch row math runs whatever the backend option says.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from liger_patch.ops import budget, validation
from liger_patch.ops.distillation import flat_operands
from liger_patch.ops.distillation_chunks import TORCH_MATH, Side, distill_chunk_rows
from liger_patch.ops.distillation_options import DistillOptions, build_distill_options
from liger_patch.ops.distillation_rows import (
    divergence_of_sums,
    shard_distill_grad,
    shard_divergence_sums,
    shard_stats,
    side_logits,
)
from liger_patch.ops.fused_linear_ce import autocast_inputs
from liger_patch.ops.gemm import gemm_dtype_for, gemm_logits
from liger_patch.ops.grad_weight_layout import accumulate_grad_weight
from liger_patch.ops.reduction import loss_divisor, reduce_rows, row_weights
from liger_patch.ops.vocab_parallel import (
    VocabShard,
    all_gather_stats,
    check_ranks_agree,
    check_shard_tensors,
)

__all__ = ["vocab_parallel_distillation"]

_F32 = torch.float32


def _f32(bias: Tensor | None) -> Tensor | None:
    return None if bias is None else bias.float()


@dataclass(frozen=True)
class _Heads:
    """Both sides' shard operands as the GEMMs read them, the kept rows and the chunk size."""

    hs: Tensor
    ws: Tensor
    bs: Tensor | None
    ht: Tensor
    wt: Tensor
    bt: Tensor | None
    kept: Tensor
    step: int

    @staticmethod
    def of(student: tuple, teacher: tuple, kept: Tensor, opts: DistillOptions) -> _Heads:
        (hs, ws, bs), (ht, wt, bt) = student, teacher
        ws, wt = ws.to(gemm_dtype_for(hs)), wt.to(gemm_dtype_for(ht))
        working = budget.working_bytes(opts.memory_budget, hs.shape[0], hs.nbytes)
        # The PyTorch row math's bytes per row: this op runs that math whatever the backend.
        sides = Side(hs, ws, None), Side(ht, wt, None)
        step = distill_chunk_rows(
            TORCH_MATH, kept.shape[0], *sides, opts, want_grad=True, gathers=True, budget=working
        )
        return _Heads(hs, ws, _f32(bs), ht, wt, _f32(bt), kept, step)

    def chunks(self):
        """The kept rows' numbers, a chunk at a time."""
        for start in range(0, self.kept.shape[0], self.step):
            yield self.kept[start : start + self.step]

    def a(self, rows: Tensor, opts: DistillOptions, want_slope: bool = False):
        """Both sides' final logits at the temperature at the shard's columns, and the student's slope."""
        hs = self.hs.index_select(0, rows).to(self.ws.dtype)
        a_s, slope = side_logits(gemm_logits(hs, self.ws, self.bs, _F32), opts.student, want_slope)
        ht = self.ht.index_select(0, rows).to(self.wt.dtype)
        a_t, _ = side_logits(gemm_logits(ht, self.wt, self.bt, _F32), opts.teacher)
        return hs, a_s, slope, a_t


def _label_cols(labels: Tensor, rows: Tensor, shard: VocabShard, vocab_r: int) -> Tensor:
    """The rows' labels as columns of the shard, -1 where the label is in another shard."""
    col = labels.index_select(0, rows) - shard.offset
    return torch.where((col >= 0) & (col < vocab_r), col, -1)


@torch.no_grad()
def _combined_stats(heads: _Heads, labels: Tensor, shard: VocabShard, opts: DistillOptions) -> dict:
    """Pass 1: the rows' log-sum-exps (and the student's logit at the label), every shard's combined."""
    k, n = (4 if opts.ce_weight else 2), labels.shape[0]
    stats = torch.zeros(k, n, dtype=_F32, device=labels.device)
    if heads.ws.shape[0] == 0:  # no columns: exp(lse_r) = 0, no label here
        stats[: k - 1 if opts.ce_weight else k] = -torch.inf
    else:
        for rows in heads.chunks():
            _, a_s, _, a_t = heads.a(rows, opts)
            cols = _label_cols(labels, rows, shard, heads.ws.shape[0])
            stats.index_copy_(1, rows, torch.stack(shard_stats(a_s, a_t, cols, opts)))
    g = all_gather_stats(stats, shard.group)
    rows = {"lse_s": torch.logsumexp(g[:, 0], dim=0), "lse_t": torch.logsumexp(g[:, 1], dim=0)}
    if opts.ce_weight:  # logsumexp(T log p_s) = logsumexp(z_s) - T lse_s, and the cross-entropy
        lse_z = torch.logsumexp(g[:, 2], dim=0)
        rows["lse_q"] = lse_z - opts.temperature * rows["lse_s"]
        rows["ce"] = lse_z - g[:, 3].sum(dim=0)
    return rows


def _log_probs(heads: _Heads, rows: Tensor, stats: dict, opts: DistillOptions, want_slope: bool = False):
    """The shard's columns of both sides' log-probs (normalised by the whole rows)."""
    hs, a_s, slope, a_t = heads.a(rows, opts, want_slope)
    ls = a_s.sub_(stats["lse_s"].index_select(0, rows).unsqueeze(-1))
    return hs, ls, slope, a_t.sub_(stats["lse_t"].index_select(0, rows).unsqueeze(-1))


@torch.no_grad()
def _divergence_sums(heads: _Heads, stats: dict, shard: VocabShard, opts: DistillOptions, n: int) -> Tensor:
    """Pass 2: the rows' divergence sums (``shard_divergence_sums``), summed over every shard."""
    k = 1 if opts.beta in (0.0, 1.0) else 2
    sums = torch.zeros(k, n, dtype=_F32, device=heads.hs.device)
    if heads.ws.shape[0]:
        for rows in heads.chunks():
            _, ls, _, lt = _log_probs(heads, rows, stats, opts)
            sums.index_copy_(1, rows, shard_divergence_sums(ls, lt, opts.beta))
    dist.all_reduce(sums, group=shard.group)
    return sums


@torch.no_grad()
def _shard_grads(heads, labels, stats, row_sum, coef, shard, opts, needs, dtypes) -> list[Tensor | None]:
    """The backward: this rank's part of grad_h and its shard's grad_W and grad_b (see the module doc)."""
    hs, ws, vocab_r = heads.hs, heads.ws, heads.ws.shape[0]
    grad_h = torch.zeros(hs.shape, dtype=_F32, device=hs.device) if needs[0] else None
    grad_w = torch.zeros(ws.shape, dtype=_F32, device=hs.device) if needs[1] else None
    grad_b = torch.zeros(vocab_r, dtype=_F32, device=hs.device) if needs[2] else None
    for rows in heads.chunks() if vocab_r else ():
        h, ls, slope, lt = _log_probs(heads, rows, stats, opts, want_slope=True)
        cols = _label_cols(labels, rows, shard, vocab_r)
        lse_q = stats["lse_q"].index_select(0, rows) if opts.ce_weight else None
        g = shard_distill_grad(
            ls, lt, slope, cols, row_sum.index_select(0, rows), lse_q, opts, coef.index_select(0, rows)
        )
        del ls, lt, slope
        g_gemm = g.to(ws.dtype)
        if grad_h is not None:
            grad_h.index_copy_(0, rows, (g_gemm @ ws).float())
        if grad_w is not None:
            accumulate_grad_weight(grad_w, g_gemm, h, first=False)
        if grad_b is not None:
            grad_b += g.sum(dim=0)
    if grad_h is not None:
        dist.all_reduce(grad_h, group=shard.group)  # every shard's part of d loss / d hidden
    grads = (grad_h, grad_w, grad_b)
    return [None if g is None else g.to(dtype) for g, dtype in zip(grads, dtypes, strict=True)]


class _VocabParallelDistill(torch.autograd.Function):
    """The loss of the student's and the teacher's vocabulary shards; see the module doc."""

    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, tb, labels, num_items, num_items_value, shard, opts):
        labels = labels.long().contiguous()
        keep = labels != opts.ignore_index
        divisor = loss_divisor(opts.student, keep, labels, None, num_items, num_items_value)
        needs = list(ctx.needs_input_grad[:3])
        check_ranks_agree(labels, shard, opts.student, divisor if num_items is not None else None, needs)
        kept = keep.nonzero().view(-1)
        with torch.autocast(sh.device.type, enabled=False):
            heads = _Heads.of((sh, sw, sb), (th, tw, tb), kept, opts)
            stats = _combined_stats(heads, labels, shard, opts)
            sums = _divergence_sums(heads, stats, shard, opts, labels.shape[0])
        d = divergence_of_sums(sums, opts.beta)
        rows = d if not opts.ce_weight else (1.0 - opts.ce_weight) * d + opts.ce_weight * stats["ce"]
        rows = torch.where(keep, rows, 0.0)
        ctx.set_materialize_grads(False)
        # The teacher's tensors get no gradient; inference tensors cannot be saved: kept as attributes.
        teacher = (th, tw, tb)
        inference = [t is not None and t.is_inference() for t in teacher]
        ctx.teacher_inference = tuple(t if inf else None for t, inf in zip(teacher, inference, strict=True))
        saved_teacher = (None if inf else t for t, inf in zip(teacher, inference, strict=True))
        row_weight = row_weights(keep, opts.reduction, divisor)
        ctx.save_for_backward(sh, sw, sb, labels, row_weight, sums[-1], *saved_teacher)
        ctx.stats, ctx.kept, ctx.shard, ctx.opts = stats, kept, shard, opts
        return reduce_rows(rows, opts.reduction, divisor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        sh, sw, sb, labels, row_weight, row_sum, *saved = ctx.saved_tensors
        teacher = tuple(t if t is not None else i for t, i in zip(saved, ctx.teacher_inference, strict=True))
        needs = ctx.needs_input_grad[:3]
        coef = row_weight * (0.0 if grad_loss is None else grad_loss.float())
        with torch.autocast(sh.device.type, enabled=False):
            heads = _Heads.of((sh, sw, sb), teacher, ctx.kept, ctx.opts)
            dtypes = (sh.dtype, sw.dtype, None if sb is None else sb.dtype)
            grads = _shard_grads(heads, labels, ctx.stats, row_sum, coef, ctx.shard, ctx.opts, needs, dtypes)
        return (*grads, *(None,) * 8)


def _checked_side(side: str, hidden, weight, labels, bias, shard: VocabShard) -> tuple:
    """One side's tensors checked as the vocabulary-parallel cross-entropy checks its own (the
    message says which side), then cast as autocast casts an ``nn.Linear``'s inputs."""
    try:
        check_shard_tensors(hidden, weight, labels, bias, None, shard)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{side}: {exc}") from None
    return autocast_inputs(hidden, weight, bias)


def vocab_parallel_distillation(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    *,
    shard: VocabShard,
    num_items_in_batch: int | float | Tensor | None = None,
    **options: Any,
) -> Tensor:
    """``fused_linear_distillation`` for heads sharded over the vocabulary across ``shard.group``.

    ``student_weight`` (V_r, H_s), ``teacher_weight`` (V_r, H_t) and the biases (V_r,) are this
    rank's rows ``[shard.offset, shard.offset + V_r)`` of both heads (the same rows);
    ``student_hidden`` (..., H_s), ``teacher_hidden`` (..., H_t), ``labels`` (...) and
    ``num_items_in_batch`` are the same on every rank of the group. ``options`` are
    ``fused_linear_distillation``'s. Every rank must call it (it runs collectives) and gets the
    whole loss; the backward gives each rank its shard's weight and bias gradients and the whole
    hidden gradient. The teacher's tensors get none.
    """
    opts = build_distill_options(where="vocab_parallel_distillation", **options)
    validation.check_num_items(num_items_in_batch, opts.reduction)
    sh, sw, sb = _checked_side("student", student_hidden, student_weight, labels, student_bias, shard)
    th, tw, tb = _checked_side("teacher", teacher_hidden, teacher_weight, labels, teacher_bias, shard)
    if sw.shape[0] != tw.shape[0]:
        raise ValueError(
            f"the student's shard has {sw.shape[0]} rows but the teacher's {tw.shape[0]}: both heads' shards "
            "must hold the same rows of the vocabulary"
        )
    if sh.device != th.device:
        raise ValueError(f"the student's tensors are on {sh.device} but the teacher's on {th.device}")
    operands = flat_operands((sh, sw, sb), (th, tw, tb), labels, num_items_in_batch)
    loss = _VocabParallelDistill.apply(*operands, shard, opts)
    return loss.reshape(labels.shape) if opts.reduction == "none" else loss
