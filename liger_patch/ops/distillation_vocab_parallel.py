"""The fused distillation loss on heads sharded over the vocabulary (tensor parallelism), never
building ``tokens x V`` logits, nor ``tokens x V/tp``: only chunks within the memory budget.

Each rank of a process group holds rows ``[offset, offset + V_r)`` of the student's (V, H_s)
weight and of the teacher's (V, H_t) (the same rows: ``VocabShard``, as a ``ColwiseParallel``
head splits them), and the *same* hidden states and labels as the other ranks of its group. The
loss and the student's gradients are exactly ``fused_linear_distillation``'s on the whole heads
(docs/distillation.md has the math); the row math is ``distillation_rows``' own, its shard
functions taking what a row needs from every shard, and each pass is the fused op's own chunk
loop (``distillation_chunks.walk_chunks``) with this op's step, the collectives between passes:

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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from liger_patch.ops import budget, validation
from liger_patch.ops.distillation import flat_operands
from liger_patch.ops.distillation_chunks import (
    ChunkMath,
    Head,
    Rows,
    Side,
    StudentGrads,
    side_chunk,
    torch_row_bytes,
    walk_chunks,
)
from liger_patch.ops.distillation_options import DistillOptions, build_distill_options
from liger_patch.ops.distillation_rows import (
    divergence_of_sums,
    shard_distill_grad,
    shard_divergence_sums,
    shard_stats,
    side_logits,
)
from liger_patch.ops.fused_linear_ce import autocast_inputs
from liger_patch.ops.reduction import loss_divisor, reduce_rows, row_weights
from liger_patch.ops.vocab_parallel import (
    VocabShard,
    all_gather_stats,
    check_ranks_agree,
    check_shard_tensors,
)

__all__ = ["vocab_parallel_distillation"]

_F32 = torch.float32


@dataclass(frozen=True)
class _ShardChunks:
    """Both sides' shards as the chunk GEMMs read them, and what every pass over their kept rows'
    chunks shares (``distillation_chunks.walk_chunks``, the fused op's own loop)."""

    student: Side
    teacher: Side
    labels: Tensor
    kept: Tensor
    shard: VocabShard
    opts: DistillOptions
    budget_bytes: int

    @staticmethod
    def of(
        student: tuple, teacher: tuple, labels: Tensor, kept: Tensor, shard: VocabShard, opts: DistillOptions
    ) -> _ShardChunks:
        s, t = Side.of(Head(*student)), Side.of(Head(*teacher))
        working = budget.working_bytes(opts.memory_budget, s.hidden.shape[0], s.hidden.nbytes)
        return _ShardChunks(s, t, labels, kept, shard, opts, working)

    @property
    def vocab_r(self) -> int:
        return self.student.w.shape[0]

    def walk(
        self,
        step: Callable[..., tuple],
        values: Tensor | None = None,
        coef: Tensor | None = None,
        grads: StudentGrads | None = None,
    ) -> None:
        """One pass of ``step`` over the chunks; none for a shard without columns. The chunks are
        as large as the PyTorch row math's bytes allow: this op runs that math whatever the backend."""
        if self.vocab_r:
            walk_chunks(
                ChunkMath(step=step, row_bytes=torch_row_bytes),
                self.student,
                self.teacher,
                self.labels,
                self.opts,
                kept=self.kept,
                coef=coef,
                budget_bytes=self.budget_bytes,
                values=values,
                grads=grads,
            )


def _label_cols(labels: Tensor, shard: VocabShard, vocab_r: int) -> Tensor:
    """Labels as columns of the shard, -1 where the label is in another shard."""
    col = labels - shard.offset
    return torch.where((col >= 0) & (col < vocab_r), col, -1)


def _stats_step(
    shard: VocabShard, rows: Rows, student: Side, teacher: Side, labels: Tensor, _coef, opts: DistillOptions
) -> tuple[Tensor, None, None]:
    """Pass 1's chunk: per row over the shard's columns, ``shard_stats`` (rows, k)."""
    a_s = side_chunk(rows, student, opts.student, side_logits)[1]
    a_t = side_chunk(rows, teacher, opts.teacher, side_logits)[1]
    cols = _label_cols(rows.take(labels), shard, student.w.shape[0])
    return torch.stack(shard_stats(a_s, a_t, cols, opts), dim=1), None, None


@torch.no_grad()
def _combined_stats(chunks: _ShardChunks) -> dict:
    """Pass 1: the rows' log-sum-exps (and the student's logit at the label), every shard's combined."""
    opts, labels, shard = chunks.opts, chunks.labels, chunks.shard
    k, n = (4 if opts.ce_weight else 2), labels.shape[0]
    stats = torch.zeros(n, k, dtype=_F32, device=labels.device)
    if chunks.vocab_r == 0:  # no columns: exp(lse_r) = 0, no label here
        stats[:, : k - 1 if opts.ce_weight else k] = -torch.inf
    chunks.walk(functools.partial(_stats_step, shard), values=stats)
    g = all_gather_stats(stats.T, shard.group)
    rows = {"lse_s": torch.logsumexp(g[:, 0], dim=0), "lse_t": torch.logsumexp(g[:, 1], dim=0)}
    if opts.ce_weight:  # logsumexp(T log p_s) = logsumexp(z_s) - T lse_s, and the cross-entropy
        lse_z = torch.logsumexp(g[:, 2], dim=0)
        rows["lse_q"] = lse_z - opts.temperature * rows["lse_s"]
        rows["ce"] = lse_z - g[:, 3].sum(dim=0)
    return rows


def _log_probs(
    rows: Rows, student: Side, teacher: Side, stats: dict, opts: DistillOptions, want_slope: bool = False
) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """The shard's columns of both sides' log-probs (normalised by the whole rows), the student's
    hidden rows and its softcap's slope."""
    hs, a_s, slope = side_chunk(rows, student, opts.student, side_logits, want_slope)
    a_t = side_chunk(rows, teacher, opts.teacher, side_logits)[1]
    ls = a_s.sub_(rows.take(stats["lse_s"]).unsqueeze(-1))
    return hs, ls, slope, a_t.sub_(rows.take(stats["lse_t"]).unsqueeze(-1))


def _sums_step(
    stats: dict, rows: Rows, student: Side, teacher: Side, _labels, _coef, opts: DistillOptions
) -> tuple[Tensor, None, None]:
    """Pass 2's chunk: the shard's part of the rows' divergence sums (rows, k)."""
    _, ls, _, lt = _log_probs(rows, student, teacher, stats, opts)
    return shard_divergence_sums(ls, lt, opts.beta).T, None, None


@torch.no_grad()
def _divergence_sums(chunks: _ShardChunks, stats: dict) -> Tensor:
    """Pass 2: the rows' divergence sums (``shard_divergence_sums``), summed over every shard."""
    k = 1 if chunks.opts.beta in (0.0, 1.0) else 2
    sums = torch.zeros(chunks.labels.shape[0], k, dtype=_F32, device=chunks.labels.device)
    chunks.walk(functools.partial(_sums_step, stats), values=sums)
    sums = sums.T.contiguous()
    dist.all_reduce(sums, group=chunks.shard.group)
    return sums


def _grad_step(
    shard: VocabShard,
    stats: dict,
    row_sum: Tensor,
    rows: Rows,
    student: Side,
    teacher: Side,
    labels: Tensor,
    coef: Tensor,
    opts: DistillOptions,
) -> tuple[None, Tensor, Tensor]:
    """The backward's chunk: the gradient at the shard's columns from the rows' sums."""
    hs, ls, slope, lt = _log_probs(rows, student, teacher, stats, opts, want_slope=True)
    cols = _label_cols(rows.take(labels), shard, student.w.shape[0])
    lse_q = rows.take(stats["lse_q"]) if opts.ce_weight else None
    g = shard_distill_grad(ls, lt, slope, cols, rows.take(row_sum), lse_q, opts, rows.take(coef))
    return None, g, hs


@torch.no_grad()
def _shard_grads(
    chunks: _ShardChunks, student: Head, stats: dict, row_sum: Tensor, coef: Tensor, needs: tuple
) -> tuple:
    """The backward: this rank's part of grad_h and its shard's grad_W and grad_b (see the module doc)."""
    grads = StudentGrads(student, chunks.student.w, needs, chunks.kept, in_fp32=True)
    chunks.walk(functools.partial(_grad_step, chunks.shard, stats, row_sum), coef=coef, grads=grads)
    if grads.grad_hidden is not None:  # every shard's part of d loss / d hidden
        dist.all_reduce(grads.grad_hidden, group=chunks.shard.group)
    return grads.finish(student)


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
            chunks = _ShardChunks.of((sh, sw, sb), (th, tw, tb), labels, kept, shard, opts)
            stats = _combined_stats(chunks)
            sums = _divergence_sums(chunks, stats)
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
            chunks = _ShardChunks.of((sh, sw, sb), teacher, labels, ctx.kept, ctx.shard, ctx.opts)
            grads = _shard_grads(chunks, Head(sh, sw, sb), ctx.stats, row_sum, coef, needs)
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
