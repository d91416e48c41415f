"""The fused distillation loss on heads sharded over the vocabulary (tensor parallelism), never
building ``tokens x V`` logits, nor ``tokens x V/tp``: only chunks within the memory budget.

Each rank of a process group holds rows ``[offset, offset + V_r)`` of the student's (V, H_s)
weight and of the teacher's (V, H_t) (the same rows: ``VocabShard``, as a ``ColwiseParallel``
head splits them), and the *same* hidden states and labels as the other ranks of its group. The
loss and the student's gradients are exactly ``fused_linear_distillation``'s on the whole heads
(docs/distillation.md has the math). The forward is one walk of the fused op's chunk loop
(``distillation_chunks.walk_chunks``), every rank over the same chunks of the kept tokens, with
the group's collectives on each chunk while it is hot (the row math per backend:
``distillation_shard_math``):

* both logits GEMMs over the shard's columns; per row, the log-sum-exp of the student's and the
  teacher's logits at the temperature (and with ``ce_weight``, of the student's final logits and
  its logit at the label when the label is in the shard); one all-gather; every rank combines
  them into the rows' (the same bits on every rank);
* with the rows' log-sum-exps the shard's log-probs are the rows' own at its columns, so it sums
  its part of the divergence per row (D, or KL(p_t || m) and KL(p_s || m)); one all-reduce gives
  the rows' sums and the loss ``(1 - w) D + w ce``;
* with reduction "mean" or "sum" (one scalar upstream gradient) and a student not in fp16, as the
  fused op: the gradient at the shard's columns from the rows' sums (KL(p_s || p_t) or
  KL(p_s || m) is what beta > 0 subtracts), then the shard's grad_W and grad_b (complete) and
  its part of grad_h, summed over the group after the walk (one all-reduce, as the unpatched
  tensor-parallel head does); the backward multiplies them by the upstream gradient.

Four GEMMs per kept token, as the unsharded op. Otherwise (reduction "none", fp16) the forward
keeps each row's log-sum-exps and sums, and the backward walks again: both logits, the gradient
with per-token coefficients, the two gradient GEMMs (six in all), and grad_h's all-reduce.

Collectives: the agreement all-reduce of ``vocab_parallel`` (the ranks agree on the tokens, the
gradients wanted and the widest shard, which sizes every rank's chunks alike, before anything that
could hang; one host sync), then per chunk one all-gather of 2 or 4 numbers a token and one
all-reduce of 1 or 2 (a shard without columns takes part with empty statistics), and grad_h's
all-reduce. The teacher's tensors get no gradient; a recomputing backward reads them again
(saved, or kept as they are when they are inference tensors).
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

from liger_patch.ops.core import budget, validation
from liger_patch.ops.core.backends import pick
from liger_patch.ops.core.contexts import autocast_off, on_device, on_inputs_device, without_grad
from liger_patch.ops.core.forward_grads import ForwardGrads, grads_in_forward, spent_error
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.kept_rows import NumItems
from liger_patch.ops.core.reduction import loss_divisor, reduce_rows, row_weights
from liger_patch.ops.core.vocab_shard import (
    VocabShard,
    all_gather_stats,
    check_ranks_agree,
    check_shard_tensors,
)
from liger_patch.ops.core.walked_rows import Chunk
from liger_patch.ops.distillation.chunks import (
    ChunkMath,
    ChunkWalk,
    Head,
    Side,
    finished_grads,
    student_grads,
    walk_chunks,
)
from liger_patch.ops.distillation.functional import flat_operands
from liger_patch.ops.distillation.operator import held_teacher, hold_teacher
from liger_patch.ops.distillation.options import (
    DistillOptions,
    build_distill_options,
    check_logits_dtypes,
)
from liger_patch.ops.distillation.rows import divergence_of_sums
from liger_patch.ops.distillation.shard_math import TORCH, TritonMath

__all__ = ["vocab_parallel_distillation"]

_F32 = torch.float32


@dataclass(frozen=True)
class _ShardChunks:
    """Both sides' shards and the kept rows as every pass over their chunks reads them
    (``walked``, for ``distillation_chunks.walk_chunks``, the fused op's own loop), the shard, and
    the row math. ``widest``: the group's widest shard, which sizes every rank's chunks alike."""

    walked: ChunkWalk
    shard: VocabShard
    widest: int
    math: Any  # distillation_shard_math.TORCH or a TritonMath

    @staticmethod
    def of(student: tuple, teacher: tuple, rows: _ShardRows) -> _ShardChunks:
        s, t = Side.of(Head(*student)), Side.of(Head(*teacher))
        opts = rows.opts
        working = budget.working_bytes(opts.memory_budget, s.hidden.shape[0], s.hidden.nbytes)
        backend = pick(opts.backend, s.hidden.device)
        math = TORCH if backend.name == "torch" else TritonMath(backend)
        walked = ChunkWalk(s, t, rows.labels, opts, rows.kept, working)
        return _ShardChunks(walked, rows.shard, rows.widest, math)

    def walk(
        self,
        step: Callable[..., tuple],
        values: Tensor | None = None,
        coef: Tensor | None = None,
        grads: GradSums | None = None,
    ) -> None:
        """One pass of ``step`` over the chunks, the same chunks on every rank (a shard without
        columns walks them too: the forward's step runs collectives), as large as the row math's
        bytes allow at the group's widest shard."""

        def row_bytes(_vocab: int, *rest: Any) -> int:
            return self.math.row_bytes(self.widest, *rest)

        walk_chunks(
            ChunkMath(step=step, row_bytes=row_bytes), self.walked, coef=coef, values=values, grads=grads
        )


@dataclass(frozen=True)
class _ShardRows:
    """The rows both passes walk and the group they agree in: the labels (N,) int64, the kept
    rows' numbers, this rank's shard, the options and the group's widest shard."""

    labels: Tensor
    kept: Tensor
    shard: VocabShard
    opts: DistillOptions
    widest: int


@dataclass(frozen=True)
class _StepOn:
    """What a pass's chunk step reads beside the chunk (``ChunkMath.step``'s arguments): this
    rank's shard, the row math and, in the recomputing backward, the values the forward kept
    (``_forward_step``'s)."""

    shard: VocabShard
    math: Any
    values: Tensor | None = None


@dataclass(frozen=True)
class _DistillSettings:
    """``_VocabParallelDistill``'s operands that are not the heads' tensors nor the labels:
    ``num_items_in_batch`` (``NumItems``: a tensor or a float), the shard, the options and
    whether grad mode was on (no gradient is ever asked of them)."""

    num_items: NumItems
    shard: VocabShard
    opts: DistillOptions
    grad_on: bool


def _label_cols(labels: Tensor, shard: VocabShard, vocab_r: int) -> Tensor:
    """Labels as columns of the shard, -1 where the label is in another shard."""
    col = labels - shard.offset
    return torch.where((col >= 0) & (col < vocab_r), col, -1)


def _combine(g: Tensor, opts: DistillOptions) -> dict:
    """The rows' log-sum-exps (and cross-entropy) from every shard's ``shard_stats``, ``g`` (ranks,
    k, rows): the same bits on every rank."""
    rows = {"lse_s": torch.logsumexp(g[:, 0], dim=0), "lse_t": torch.logsumexp(g[:, 1], dim=0)}
    if opts.ce_weight:  # z_s = T a_s: its log-sum-exp and the cross-entropy
        rows["lse_z"] = torch.logsumexp(g[:, 2], dim=0)
        rows["ce"] = rows["lse_z"] - g[:, 3].sum(dim=0)
    return rows


def _no_columns_stats(n: int, opts: DistillOptions, device: torch.device) -> Tensor:
    """``shard_stats`` (k, n) of a shard without columns: exp(lse) = 0, no label here."""
    k = 4 if opts.ce_weight else 2
    stats = torch.full((k, n), -torch.inf, dtype=_F32, device=device)
    if opts.ce_weight:
        stats[3] = 0.0
    return stats


def _forward_step(
    on: _StepOn,
    rows: Chunk,
    student: Side,
    teacher: Side,
    labels: Tensor,
    coef: Tensor | None,
    opts: DistillOptions,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The forward's chunk, both collectives on it while it is hot: the shard's statistics,
    all-gathered and combined into the rows' log-sum-exps; the shard's part of the divergence
    sums, all-reduced; with ``coef`` the gradient at the shard's columns. Its values (rows, m):
    the loss, lse_s, lse_t, (lse_z,) and the sum the gradient subtracts (``_value_columns``)."""
    shard, math = on.shard, on.math
    width, want_grad = student.w.shape[0], coef is not None
    cols = _label_cols(rows.take(labels), shard, width)
    chunk = math.open(rows, student, teacher, opts, want_grad) if width else None
    local = math.stats(chunk, cols, opts) if width else _no_columns_stats(cols.shape[0], opts, labels.device)
    stats = _combine(all_gather_stats(local, shard.group), opts)
    if width:
        sums = math.sums(chunk, stats, cols, opts, want_grad)
    else:
        k = 1 if opts.beta in (0.0, 1.0) else 2
        sums = torch.zeros(k, cols.shape[0], dtype=_F32, device=labels.device)
    dist.all_reduce(sums, group=shard.group)
    d = divergence_of_sums(sums, opts.beta)
    loss = d if not opts.ce_weight else (1.0 - opts.ce_weight) * d + opts.ce_weight * stats["ce"]
    g = hs = None
    if want_grad and width:
        g, hs = math.grad(chunk, stats, sums[-1], cols, rows.take(coef), opts), chunk.hs
    del chunk
    lse_z = [stats["lse_z"]] if opts.ce_weight else []
    return torch.stack([loss, stats["lse_s"], stats["lse_t"], *lse_z, sums[-1]], dim=1), g, hs


def _value_columns(opts: DistillOptions) -> int:
    """Columns of ``_forward_step``'s values."""
    return 5 if opts.ce_weight else 4


def _values_stats(values: Tensor, opts: DistillOptions) -> dict:
    """The rows' log-sum-exps the forward kept (columns of ``_forward_step``'s values)."""
    stats = {"lse_s": values[:, 1], "lse_t": values[:, 2]}
    if opts.ce_weight:
        stats["lse_z"] = values[:, 3]
    return stats


def _grad_step(
    on: _StepOn,
    rows: Chunk,
    student: Side,
    teacher: Side,
    labels: Tensor,
    coef: Tensor,
    opts: DistillOptions,
) -> tuple[None, Tensor | None, Tensor | None]:
    """The recomputing backward's chunk: the gradient at the shard's columns from the rows'
    log-sum-exps and sums the forward kept (none for a shard without columns). The divergence
    sums are computed again (their parts make the gradient); the kept ones are used."""
    shard, math = on.shard, on.math
    width = student.w.shape[0]
    if not width:
        return None, None, None
    chunk_values = rows.take(on.values)
    stats = _values_stats(chunk_values, opts)
    cols = _label_cols(rows.take(labels), shard, width)
    chunk = math.open(rows, student, teacher, opts, True)
    if math is TORCH:  # its gradient's parts come with the sums
        math.sums(chunk, stats, cols, opts, True)
    g = math.grad(chunk, stats, chunk_values[:, -1], cols, rows.take(coef), opts)
    return None, g, chunk.hs


@without_grad
def _walk_grads(chunks: _ShardChunks, student: Head, needs: tuple, step: Callable, **walk: Any) -> tuple:
    """A pass that sums the student's gradients: this rank's part of grad_h, summed over the
    group (one all-reduce, as the unpatched tensor-parallel head does), and its shard's grad_W and
    grad_b (complete); ``None`` where not asked for, else in the inputs' dtypes."""
    grads = student_grads(student, chunks.walked.student.w, needs, chunks.walked.kept, in_fp32=True)
    chunks.walk(step, grads=grads, **walk)
    if grads.hidden is not None:
        dist.all_reduce(grads.hidden, group=chunks.shard.group)
    return finished_grads(grads, student)


class _VocabParallelDistill(torch.autograd.Function):
    """The loss of the student's and the teacher's vocabulary shards; see the module doc."""

    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, tb, labels, settings: _DistillSettings):
        opts, shard, num_items = settings.opts, settings.shard, settings.num_items
        labels = labels.long().contiguous()
        keep = labels != opts.ignore_index
        divisor = loss_divisor(opts.reduction, keep, labels, None, num_items.tensor, num_items.value)
        needs = [settings.grad_on and n for n in ctx.needs_input_grad[:3]]  # none under no_grad (evaluation)
        user_divisor = divisor if num_items.tensor is not None else None
        (widest,) = check_ranks_agree(labels, shard, opts.ignore_index, user_divisor, needs, (sw.shape[0],))
        kept = keep.nonzero().view(-1)
        row_weight = row_weights(keep, opts.reduction, divisor)
        precompute = grads_in_forward(opts.reduction, sh.dtype, needs)
        values = torch.zeros(labels.shape[0], _value_columns(opts), dtype=_F32, device=labels.device)
        with autocast_off(sh.device.type):
            rows = _ShardRows(labels, kept, shard, opts, widest)
            chunks = _ShardChunks.of((sh, sw, sb), (th, tw, tb), rows)
            step = functools.partial(_forward_step, _StepOn(shard, chunks.math))
            ctx.forward_grads = None
            if precompute:
                grads = _walk_grads(chunks, Head(sh, sw, sb), needs, step, values=values, coef=row_weight)
                ctx.forward_grads = ForwardGrads.held(grads, needs, opts.backend)
            else:
                chunks.walk(step, values=values)
        ctx.set_materialize_grads(False)
        ctx.needs = needs
        if precompute:  # nothing else kept: a second backward is refused
            return reduce_rows(values[:, 0].contiguous(), opts.reduction, divisor)
        ctx.save_for_backward(sh, sw, sb, labels, row_weight, values, *hold_teacher(ctx, (th, tw, tb)))
        ctx.kept, ctx.shard, ctx.opts, ctx.widest = kept, shard, opts, widest
        return reduce_rows(values[:, 0].contiguous(), opts.reduction, divisor)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        held = ctx.forward_grads
        if held is not None and not held.spent:
            return (*held.scaled(grad_loss), *(None,) * 5)
        if held is not None:
            raise spent_error("vocab_parallel_distillation")
        if not any(ctx.needs):
            return (None,) * 8
        sh, sw, sb, labels, row_weight, values, *saved = ctx.saved_tensors
        teacher = held_teacher(ctx, saved)
        coef = row_weight * (0.0 if grad_loss is None else grad_loss.float())
        with autocast_off(sh.device.type), on_device(sh.device):  # compiled autograd: the caller's device
            rows = _ShardRows(labels, ctx.kept, ctx.shard, ctx.opts, ctx.widest)
            chunks = _ShardChunks.of((sh, sw, sb), teacher, rows)
            step = functools.partial(_grad_step, _StepOn(ctx.shard, chunks.math, values))
            grads = _walk_grads(chunks, Head(sh, sw, sb), ctx.needs, step, coef=coef)
        return (*grads, *(None,) * 5)


def _checked_side(side: str, hidden, weight, labels, bias, shard: VocabShard) -> tuple:
    """One side's tensors checked as the vocabulary-parallel cross-entropy checks its own (the
    message says which side), then cast as autocast casts an ``nn.Linear``'s inputs."""
    try:
        check_shard_tensors(hidden, weight, labels, bias, None, shard)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{side}: {exc}") from None
    return validation.autocast_inputs(hidden, weight, bias)


@on_inputs_device
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
    check_logits_dtypes(opts, sh.dtype, th.dtype)
    *tensors, num_tensor, num_value = flat_operands((sh, sw, sb), (th, tw, tb), labels, num_items_in_batch)
    settings = _DistillSettings(NumItems(num_tensor, num_value), shard, opts, torch.is_grad_enabled())
    loss = _VocabParallelDistill.apply(*tensors, settings)
    return loss.reshape(labels.shape) if opts.reduction == "none" else loss
