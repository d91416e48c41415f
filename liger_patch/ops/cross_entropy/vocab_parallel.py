"""The fused loss on a weight sharded over the vocabulary (tensor parallelism), never building
``tokens x V`` logits, nor ``tokens x V/tp``: only chunks within the memory budget.

Each rank of a process group holds rows ``[offset, offset + V_r)`` of the (V, H) weight (and of
the bias) and the *same* hidden states and labels as the other ranks of its group (a
tensor-parallel head: ``ColwiseParallel``, transformers' ``tp_plan``). The loss and its
gradients are exactly those of the unsharded op:

* forward (one logits GEMM per token, in chunks): each rank computes per token the numbers of
  ``shard_stats`` over its columns (log-sum-exp, the label's logit when the label is in its
  shard, and what the options need); one all-gather brings every shard's numbers to every rank,
  which combines them (``shard_math.combine``) into the rows' log-sum-exp, label logit, etc.,
  and computes the loss with the row kernel's own row math (``torch_ce.row_loss``: an option of
  the row math needs no edit here): the same value on every rank;
* backward (three GEMMs per token): the chunked executor recomputes the shard's logits and turns
  them into d(loss)/d(logits) with the whole rows' log-sum-exp; the row kernels take a block of
  columns of wider rows (``col_offset``, ``vocab_total``), so labels outside the shard, label
  smoothing over all V and class weights come out right. Each rank's grad_W and grad_b are its
  shard's, complete; grad_h is summed over the group (one all-reduce, as the unpatched
  tensor-parallel head does).

Four GEMMs per token instead of the unsharded op's three: the gradient needs the rows' global
log-sum-exp, known only once every shard has been seen, so the forward cannot compute the
gradients while its chunk is hot. The memory stays one chunk per rank.

Collectives per call, the same number whatever the chunking (ranks' chunk plans differ when V does
not divide evenly): one all-reduce of a few integers (the ranks agree on the token count, the
labels, that every label is in [0, V), and which gradients are wanted, before anything that could
hang), one all-gather of ``k x N`` numbers (k <= 6), and in the backward the all-reduce of grad_h.
One host sync per forward (the agreement), as the unsharded op's label check.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from liger_patch.ops.core import validation
from liger_patch.ops.core.contexts import autocast_off, on_device, on_inputs_device
from liger_patch.ops.core.kept_rows import NumItems
from liger_patch.ops.core.options import check_logits_dtype, constant_changes
from liger_patch.ops.core.reduction import loss_divisor, reduce_rows, row_weights
from liger_patch.ops.core.vocab_shard import (
    VocabShard,
    all_gather_stats,
    check_ranks_agree,
    check_shard_tensors,
)
from liger_patch.ops.cross_entropy import outputs, shard_math
from liger_patch.ops.cross_entropy.backends import RowBackend, row_backend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, GradsWanted, HeadInputs
from liger_patch.ops.cross_entropy.options import DEFAULT_OPTIONS, LossOptions, build_options
from liger_patch.ops.cross_entropy.recompute import recompute_grads
from liger_patch.ops.cross_entropy.row_io import (
    NO_RECORDS,
    ChunkRecords,
    ClassWeight,
    EntropyGrad,
    GivenLse,
    RowGrad,
)
from liger_patch.ops.cross_entropy.rows import RowStats, row_loss, z_loss_rows

__all__ = ["shard_backend", "vocab_parallel_loss"]

_F32 = torch.float32


def shard_backend(base: RowBackend, shard: VocabShard) -> RowBackend:
    """``base`` with a row kernel that reads the shard's logits as columns ``[offset, offset + V_r)``
    of rows of ``shard.vocab`` logits, so ``chunks.run_chunks`` computes the shard's gradients
    from the whole rows' log-sum-exp (``ChunkCall.lse_in``) unchanged. Its column blocks (the two-pass path)
    are blocks of the shard: their offsets are shifted by the shard's."""

    def row_kernel(
        logits: Tensor,
        labels: Tensor,
        opts: LossOptions,
        *,
        grad: RowGrad | None = None,
        given: GivenLse | None = None,
        records: ChunkRecords = NO_RECORDS,
    ) -> tuple[Tensor | None, Tensor]:
        if given is None:
            raise ValueError("a vocabulary shard's row kernel needs the whole rows' log-sum-exp (lse_in)")
        shifted = GivenLse(given.lse, shard.offset + given.col_offset, shard.vocab)
        return base.row_kernel(logits, labels, opts, grad=grad, given=shifted, records=records)

    return dataclasses.replace(base, row_kernel=row_kernel, fused_logits=None)


@dataclass
class _Rows:
    """Per-token results of the forward: the loss terms and what the backward needs."""

    ce: Tensor
    z: Tensor
    lse: Tensor
    token_scale: Tensor | None
    argmax: Tensor | None
    entropy: Tensor | None


def _rows(
    comb: dict[str, Tensor], labels: Tensor, opts: LossOptions, cw: ClassWeight | None, vocab: int
) -> _Rows:
    """The loss terms per token from the combined values, through the row kernel's own row math
    (``torch_ce.row_loss``): 0 at ignored tokens."""
    keep = labels != opts.ignore_index
    stats = RowStats(comb["lse"], comb["label_logit"], comb.get("logit_sum"))
    ce, token_scale = row_loss(stats, labels, opts, cw, vocab, token_scaling=opts.use_token_scaling)
    zero = torch.zeros((), dtype=_F32, device=labels.device)
    lse = torch.where(keep, stats.lse, zero)
    z_rows = z_loss_rows(lse, opts, token_scale)
    argmax = comb.get("argmax")
    if argmax is not None:
        argmax = torch.where(keep, argmax, -1)
    entropy = comb.get("entropy")
    if entropy is not None:
        entropy = torch.where(keep, entropy, zero)
    return _Rows(ce, z_rows, lse, token_scale, argmax, entropy)


def _empty(like: Tensor, dtype: torch.dtype = _F32) -> Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


@dataclass(frozen=True)
class _ShardCall:
    """What ``_VocabParallelLoss`` takes besides the tensors that get gradients: the labels (N,),
    the class weights (V,), ``num_items_in_batch``, the shard and the options."""

    labels: Tensor
    class_weight: Tensor | None
    num_items: NumItems
    shard: VocabShard
    opts: LossOptions


class _VocabParallelLoss(torch.autograd.Function):
    """``(loss, z_loss, argmax, entropy rows)`` of a vocabulary shard; see the module doc."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, call: _ShardCall):
        opts, shard = call.opts, call.shard
        labels = call.labels.long().contiguous()
        keep = labels != opts.ignore_index
        cw = ClassWeight.of(call.class_weight)
        num_items = call.num_items
        divisor = loss_divisor(
            opts.reduction, keep, labels, None if cw is None else cw.weight, num_items.tensor, num_items.value
        )
        needs = list(ctx.needs_input_grad[:3])
        check_ranks_agree(
            labels, shard, opts.ignore_index, divisor if num_items.tensor is not None else None, needs
        )
        rows = _shard_rows(hidden, weight, bias, labels, call, cw)
        loss = reduce_rows(rows.ce + rows.z, opts.reduction, divisor)
        z_loss = reduce_rows(rows.z, opts.reduction, divisor)
        row_weight = row_weights(keep, opts.reduction, divisor)
        if rows.token_scale is not None:
            row_weight = row_weight * rows.token_scale
        argmax = rows.argmax if rows.argmax is not None else _empty(hidden, torch.int64)
        entropy = rows.entropy if rows.entropy is not None else _empty(hidden)
        ctx.mark_non_differentiable(argmax)
        if rows.entropy is None:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, labels, call.class_weight, rows.lse, row_weight, entropy)
        ctx.shard, ctx.opts = shard, opts
        return loss, z_loss, argmax, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_z, _grad_argmax, grad_entropy):
        hidden, weight, bias, labels, class_weight, lse, row_weight, entropy = ctx.saved_tensors
        opts, shard = ctx.opts, ctx.shard
        needs = ctx.needs_input_grad[:3]
        zero = torch.zeros((), dtype=_F32, device=hidden.device)
        g_loss = zero if grad_loss is None else grad_loss.float()
        g_z = zero if grad_z is None or opts.z_loss_scale == 0.0 else grad_z.float()
        call = ChunkCall(
            backend=shard_backend(row_backend(opts.backend, hidden.device), shard),
            inputs=HeadInputs(hidden, weight, bias),
            labels=labels,
            opts=opts,
            budget_bytes=0,
            coef_ce=g_loss * row_weight,
            coef_z=(g_loss + g_z) * row_weight,
            lse_in=lse,
            wanted=GradsWanted.of(needs),
            class_weight=ClassWeight.of(class_weight),
            entropy_grad=None if grad_entropy is None else EntropyGrad(grad_entropy.float(), entropy),
        )
        with on_device(hidden.device):  # compiled autograd runs a node on the caller's device
            grads = _shard_grads(call)
        if needs[0]:
            dist.all_reduce(grads[0], group=shard.group)  # every shard's part of d loss / d hidden
        return (*grads, None)


def _shard_rows(hidden, weight, bias, labels: Tensor, call: _ShardCall, cw: ClassWeight | None) -> _Rows:
    """The rows' loss terms from this shard's statistics and every other shard's (one all-gather)."""
    opts, shard = call.opts, call.shard
    names = shard_math.stat_names(opts)
    with autocast_off(hidden.device.type):
        stats = shard_math.shard_statistics(
            row_backend(opts.backend, hidden.device),
            HeadInputs(hidden, weight, bias),
            labels,
            opts,
            shard.offset,
            cw,
        )
    combined = shard_math.combine(all_gather_stats(stats, shard.group), names)
    return _rows(combined, labels, opts, cw, shard.vocab)


def _shard_grads(call: ChunkCall) -> list[Tensor | None]:
    """This rank's gradients of hidden (its shard's part), weight and bias (its shard's, complete),
    from the call's per-row coefficients of d ce and d z-loss (and of the entropy), as
    ``flce_backward``."""
    inputs, wanted = call.inputs, call.wanted
    if inputs.weight.shape[0] == 0:  # an empty shard adds nothing to grad_h, and has no rows of its own
        return [
            torch.zeros_like(t) if need and t is not None else None
            for t, need in zip(
                (inputs.hidden, inputs.weight, inputs.bias),
                (wanted.hidden, wanted.weight, wanted.bias),
                strict=True,
            )
        ]
    res = recompute_grads(call)
    return [res.grad_hidden, res.grad_weight, res.grad_bias]


@on_inputs_device
def vocab_parallel_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Tensor | None = None,
    *,
    shard: VocabShard,
    options: LossOptions = DEFAULT_OPTIONS,
    num_items_in_batch: int | float | Tensor | None = None,
    class_weight: Tensor | None = None,
    **overrides: Any,
):
    """``fused_loss`` for a weight (and bias) sharded over the vocabulary across ``shard.group``.

    ``weight`` (V_r, H) and ``bias`` (V_r,) are this rank's rows ``[shard.offset, shard.offset +
    V_r)``; ``hidden`` (..., H), ``labels`` (...) (global class ids) and ``num_items_in_batch``
    are the same on every rank of the group; ``class_weight`` (V,) covers all classes. Every rank
    must call it (it runs collectives) and gets the whole loss and the same outputs as
    ``fused_loss`` on the gathered weight would give; the backward gives each rank its shard's
    weight and bias gradients and the whole hidden gradient. Options as ``fused_loss``.
    """
    opts = build_options(options.key, **constant_changes(overrides))
    validation.check_num_items(num_items_in_batch, opts.reduction)
    check_shard_tensors(hidden, weight, labels, bias, class_weight, shard)
    hidden, weight, bias = validation.autocast_inputs(hidden, weight, bias)
    check_logits_dtype(opts.logits_dtype, hidden.dtype)
    call = _ShardCall(
        labels.reshape(-1),
        class_weight,
        NumItems(*validation.num_items_operands(num_items_in_batch)),
        shard,
        opts,
    )
    loss, z_loss, argmax, entropy = _VocabParallelLoss.apply(
        hidden.reshape(labels.numel(), hidden.shape[-1]), weight, bias, call
    )
    return outputs.pack(opts, labels, loss, z_loss, argmax, entropy)
