"""The fused loss as registered PyTorch operators (namespace ``liger_patch``), so that
``torch.compile`` captures a call as one graph node (``fullgraph=True``, dynamic shapes, CUDA graphs).

* ``liger_patch::flce`` computes the loss, its z-loss part, the argmax and entropy per token
  when asked, and what the backward needs. With reduction "mean"/"sum" the upstream gradient
  is one scalar, so the forward also computes the gradients at scale 1 while the logits chunk is
  hot, and the backward only multiplies them by that scalar (``liger_patch::scale_grads_``;
  on Triton a kernel that reads it on the device and does nothing when it is 1): three GEMMs
  per chunk in total. This is skipped for fp16 (a GradScaler's factor must be applied before
  rounding to fp16, or small gradients underflow) and whenever the backward needs something
  else (a gradient arriving through ``z_loss`` or the entropy, or a second backward over a
  retained graph); then ``liger_patch::flce_backward`` recomputes the logits with exact
  per-row coefficients, which is also the path for reduction "none".
* Every option travels as ``LossOptions.key`` (one string), tensors as tensors.
* An optional low-rank term ``(u, B)`` adds ``u B^T`` to the logits (a LoRA adapter on the head:
  ``low_rank.py``); ``needs`` then has five entries (hidden, weight, bias, u, B) and their
  gradients are the last two outputs.
* A fake implementation gives every output's shape from the inputs' (symbolic) shapes, so a
  compiled caller is not specialised to the token count.

Host synchronisation: one per forward, the label range check, and none while a CUDA graph is
being captured; a bad label then makes the loss and every gradient NaN (docs/loss.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from liger_patch.ops.core import budget, head_start
from liger_patch.ops.core.forward_grads import ForwardGrads, grads_in_forward
from liger_patch.ops.core.kept_rows import NumItems, begin_label_check, finish_label_check
from liger_patch.ops.core.reduction import (
    reduce_rows,
)
from liger_patch.ops.cross_entropy.backends import RowBackend, row_backend
from liger_patch.ops.cross_entropy.chunks import ChunkResult, run_chunks, start_head
from liger_patch.ops.cross_entropy.double_backward import differentiable_grads
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ClassWeight, EntropyGrad, RowOutputs
from liger_patch.ops.cross_entropy.rows import z_loss_rows

_F32 = torch.float32


def _low_rank_needs(needs: list[bool]) -> tuple[bool, bool]:
    """Whether u and B want gradients: ``needs``' entries 4 and 5 (absent: no)."""
    return (len(needs) > 3 and needs[3], len(needs) > 4 and needs[4])


def _wants_argmax(opts: LossOptions) -> bool:
    return opts.return_token_accuracy or opts.return_predicted_tokens


def class_weight_record(class_weight: Tensor | None) -> ClassWeight | None:
    if class_weight is None:
        return None
    weight = class_weight.to(_F32).contiguous()
    return ClassWeight(weight, weight.sum())


def _budget_bytes(
    opts: LossOptions, hidden: Tensor, weight: Tensor, labels: Tensor, kept: Tensor | None
) -> int:
    """The chunk buffers' bytes for a call that walks ``kept`` rows (every row when ``None``):
    its budget (``budget.working_bytes``), which ``"batch"`` sizes by its hidden states and by
    what one chunk of those rows would take."""
    n_rows = labels.shape[0] if kept is None else kept.shape[0]
    logit_bytes = (opts.logits_dtype or hidden.dtype).itemsize
    whole = budget.one_chunk_bytes(
        n_rows, labels.shape[0], weight.shape[0], logit_bytes, hidden.shape[1], hidden.element_size()
    )
    return budget.working_bytes(opts.memory_budget, labels.shape[0], hidden.nbytes, whole)


def _start_head(
    opts, backend, hidden, weight, bias, labels, keep, needs, precompute, cw, low_rank_u, budget_all
):
    """``chunked.start_head`` for this forward: over the kept rows where the last call of this shape
    skipped some and the budget (``budget_all``: every row's) does not depend on how many."""
    skip = head_start.expects_skip((hidden.device, labels.shape[0], weight.shape[0]))
    if skip and _budget_bytes(opts, hidden, weight, labels, labels[:1]) != budget_all:
        return None
    no_partials = low_rank_u is not None or (cw is not None and opts.label_smoothing != 0.0)
    args = (budget_all, precompute and needs[1], no_partials, keep if skip else None)
    return start_head(backend, hidden, weight, bias, opts, *args)


def _empty(like: Tensor, dtype: torch.dtype = _F32) -> Tensor:
    return torch.empty(0, dtype=dtype, device=like.device)


@torch.library.custom_op("liger_patch::flce", mutates_args=())
def flce(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    class_weight: Tensor | None,
    num_items: Tensor | None,
    num_items_value: float | None,
    options: str,
    needs: list[bool],
    low_rank_u: Tensor | None = None,
    low_rank_b: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Forward: ``(loss, z_loss, argmax, entropy, lse, row_weight, token_scale, grad_hidden,
    grad_weight, grad_bias, grad_u, grad_b)``; hidden (N, H), labels (N,), u (N, r), B (V, r).
    Outputs not asked for are empty. ``needs`` says which of hidden, weight, bias (u, B) want
    gradients."""
    opts = LossOptions.from_key(options)
    cw = class_weight_record(class_weight)
    vocab = weight.shape[0]
    class_weights = None if cw is None else cw.weight
    pending = begin_label_check(
        labels, vocab, opts.ignore_index, opts.reduction, class_weights, NumItems(num_items, num_items_value)
    )
    backend = row_backend(opts.backend, hidden.device)
    precompute = grads_in_forward(opts.reduction, hidden.dtype, needs)
    head, shape_key, budget_bytes = None, (hidden.device, labels.shape[0], vocab), None
    if pending.started is not None:  # queued now, computed while the host waits for the check below
        budget_bytes = _budget_bytes(opts, hidden, weight, pending.labels, None)  # walking every row
        head = _start_head(
            opts, backend, hidden, weight, bias, pending.labels, pending.keep, needs, precompute, cw,
            low_rank_u, budget_bytes,
        )  # fmt: skip
    checked = finish_label_check(pending, opts.tuning)
    labels, poison, kept_rows, divisor, row_weight = (
        checked.labels, checked.poison, checked.kept_rows, checked.divisor, checked.row_weight
    )  # fmt: skip
    head_start.remember(shape_key, kept_rows is not None)
    if budget_bytes is None or kept_rows is not None:
        budget_bytes = _budget_bytes(opts, hidden, weight, labels, kept_rows)
    outputs = RowOutputs.empty(
        labels.shape[0], hidden.device, _wants_argmax(opts), opts.return_entropy, opts.use_token_scaling
    )
    with torch.autocast(hidden.device.type, enabled=False):
        res = run_chunks(
            backend,
            hidden,
            weight,
            bias,
            labels,
            opts,
            budget_bytes=budget_bytes,
            coef_ce=row_weight if precompute else None,
            coef_z=row_weight if precompute else None,
            need_hidden=precompute and needs[0],
            need_weight=precompute and needs[1],
            need_bias=precompute and needs[2] and bias is not None,
            class_weight=cw,
            outputs=outputs,
            row_index=kept_rows,
            low_rank=None if low_rank_u is None else (low_rank_u, low_rank_b),
            need_low_rank=tuple(precompute and n for n in _low_rank_needs(needs)),
            head=head,
        )
    if opts.z_loss_scale == 0.0:  # the common case: no z-loss rows to make and add (launches)
        loss = reduce_rows(res.ce, opts.reduction, divisor)
        z_loss = torch.zeros_like(loss)
    else:
        z_rows = z_loss_rows(res.lse, opts, outputs.token_scale)  # the kernels scaled ce already
        loss = reduce_rows(res.ce + z_rows, opts.reduction, divisor)
        z_loss = reduce_rows(z_rows, opts.reduction, divisor)
    if poison is not None:
        loss, z_loss = loss * poison, z_loss * poison

    def given(t: Tensor | None, dtype: torch.dtype = _F32) -> Tensor:  # outputs may not be None
        return t if t is not None else _empty(hidden, dtype)

    return (
        loss,
        z_loss,
        given(outputs.argmax, torch.int64),
        given(outputs.entropy),
        res.lse,
        row_weight,
        given(outputs.token_scale),
        given(res.grad_hidden),
        given(res.grad_weight),
        given(res.grad_bias),
        given(res.grad_u),
        given(res.grad_b),
    )


@flce.register_fake
def _flce_fake(
    hidden,
    weight,
    bias,
    labels,
    class_weight,
    num_items,
    num_items_value,
    options,
    needs,
    low_rank_u=None,
    low_rank_b=None,
):
    opts = LossOptions.from_key(options)
    n = labels.shape[0]
    loss_shape = (n,) if opts.reduction == "none" else ()

    def rows(wanted: bool, dtype: torch.dtype = _F32) -> Tensor:
        return hidden.new_empty((n,) if wanted else (0,), dtype=dtype)

    precompute = grads_in_forward(opts.reduction, hidden.dtype, needs)

    def grad_like(t: Tensor | None, need: bool) -> Tensor:
        return (
            t.new_empty(t.shape) if t is not None and precompute and need else hidden.new_empty(0, dtype=_F32)
        )

    return (
        hidden.new_empty(loss_shape, dtype=_F32),
        hidden.new_empty(loss_shape, dtype=_F32),
        rows(_wants_argmax(opts), torch.int64),
        rows(opts.return_entropy),
        rows(True),
        rows(True),
        rows(opts.use_token_scaling),
        grad_like(hidden, needs[0]),
        grad_like(weight, needs[1]),
        grad_like(bias, needs[2]),
        *(
            grad_like(t, need)
            for t, need in zip((low_rank_u, low_rank_b), _low_rank_needs(needs), strict=True)
        ),
    )


@torch.library.custom_op("liger_patch::flce_backward", mutates_args=())
def flce_backward(
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
    entropy_grad = None if entropy_coef is None else EntropyGrad(entropy_coef.float(), entropy)
    res = recompute_grads(
        row_backend(opts.backend, hidden.device),
        (hidden, weight, bias),
        labels.long().contiguous(),
        class_weight,
        opts,
        needs,
        lse=lse,
        coef_ce=coef_ce,
        coef_z=coef_z,
        entropy_grad=entropy_grad,
        low_rank=None if low_rank_u is None else (low_rank_u, low_rank_b),
    )
    grads = (res.grad_hidden, res.grad_weight, res.grad_bias, res.grad_u, res.grad_b)
    return tuple(g if g is not None else _empty(hidden) for g in grads)


def recompute_grads(
    backend: RowBackend,
    inputs: tuple[Tensor, Tensor, Tensor | None],
    labels: Tensor,
    class_weight: Tensor | None,
    opts: LossOptions,
    needs: list[bool] | tuple[bool, ...],
    *,
    lse: Tensor,
    coef_ce: Tensor,
    coef_z: Tensor,
    entropy_grad: EntropyGrad | None,
    low_rank: tuple[Tensor, Tensor] | None = None,
) -> ChunkResult:
    """The gradients of ``inputs`` (hidden, weight, bias) that ``needs`` asks for, from logits
    recomputed with the rows' log-sum-exp ``lse`` and per-row coefficients of d ce, d z-loss and
    (``entropy_grad``) d entropy: the backward of ``flce`` and of the vocabulary-parallel loss
    (whose ``backend`` reads a shard's columns of wider rows). ``low_rank``: the term ``(u, B)``,
    whose gradients ``needs``' entries 4 and 5 ask for."""
    hidden, weight, bias = inputs
    with torch.autocast(hidden.device.type, enabled=False):
        return run_chunks(
            backend,
            hidden,
            weight,
            bias,
            labels,
            opts,
            budget_bytes=_budget_bytes(opts, hidden, weight, labels, None),
            coef_ce=coef_ce,
            coef_z=coef_z,
            lse_in=lse,
            need_hidden=needs[0],
            need_weight=needs[1],
            need_bias=needs[2] and bias is not None,
            class_weight=class_weight_record(class_weight),
            entropy_grad=entropy_grad,
            low_rank=low_rank,
            need_low_rank=_low_rank_needs(needs),
        )


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
            (hidden, weight, bias, low_rank_u, low_rank_b), (*needs[:3], *_low_rank_needs(needs)), strict=True
        )
    )


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, labels, class_weight, _, _, options, needs, *term = inputs
    _, _, argmax, entropy, lse, row_weight, token_scale, *pre = output
    opts = LossOptions.from_key(options)
    ctx.set_materialize_grads(False)  # an output nobody used gives None, not zeros to compute with
    ctx.mark_non_differentiable(argmax, lse, row_weight, token_scale, *pre)
    if not opts.return_entropy:
        ctx.mark_non_differentiable(entropy)
    u, b = (*term, None, None)[:2]
    ctx.save_for_backward(
        hidden, weight, bias, labels, class_weight, lse, row_weight, token_scale, entropy, u, b
    )
    ctx.options, ctx.needs = options, [*needs[:3], *_low_rank_needs(needs)]
    ctx.forward_grads = None  # a second backward recomputes, once the first took them
    if grads_in_forward(opts.reduction, hidden.dtype, needs):
        ctx.forward_grads = ForwardGrads.held(tuple(pre), ctx.needs, opts.backend)
    ctx.head_shapes = _shapes(weight, bias)


def _shapes(weight: Tensor, bias: Tensor | None) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    return tuple(weight.shape), None if bias is None else tuple(bias.shape)


def _check_head_whole(ctx, weight: Tensor, bias: Tensor | None) -> None:
    """Raise when the weight (or bias) the backward must recompute from is no longer what the
    forward saw: a sharding wrapper freed or resharded it in between (DeepSpeed ZeRO-3 empties a
    parameter's data once its module's call ends), which would otherwise fail deep in a kernel."""
    now = _shapes(weight, bias)
    if now != ctx.head_shapes:
        raise RuntimeError(
            f"liger_patch: the backward recomputes from the weight and bias the forward saved, of shapes "
            f"{ctx.head_shapes} then and {now} now: "
            "something freed or resharded them after the forward (DeepSpeed ZeRO-3 empties a parameter "
            "once its module's call ends). Run the backward where they are whole again (for ZeRO-3, call "
            "the op inside the head module's own call, or re-gather them for the backward)."
        )


def _backward(ctx, grad_loss, grad_z, _grad_argmax, grad_entropy, *_no_grads):
    hidden, weight, bias, labels, class_weight, lse, row_weight, token_scale, entropy, u, b = (
        ctx.saved_tensors
    )
    opts = LossOptions.from_key(ctx.options)
    if torch.is_grad_enabled():  # create_graph=True: a graph for a second derivative
        _check_head_whole(ctx, weight, bias)
        saved = (hidden, weight, bias, labels, row_weight, token_scale, u, b)
        cw = class_weight_record(class_weight)
        return _input_grads(differentiable_grads(saved, opts, ctx.needs, cw, grad_loss, grad_z, grad_entropy))
    z_grad_matters = grad_z is not None and opts.z_loss_scale != 0.0
    # Whichever way this backward goes, the node holds the forward's gradients no longer (they
    # are scaled in place below, or not needed): a second backward recomputes.
    held, ctx.forward_grads = ctx.forward_grads, None
    if held is not None and not z_grad_matters and grad_entropy is None:
        return _input_grads(held.scaled(grad_loss))

    _check_head_whole(ctx, weight, bias)
    zero = torch.zeros((), dtype=_F32, device=hidden.device)
    g_loss = zero if grad_loss is None else grad_loss.float()
    g_z = zero if grad_z is None else grad_z.float()
    row_coef = row_weight * token_scale if opts.use_token_scaling else row_weight
    grads = torch.ops.liger_patch.flce_backward(
        hidden,
        weight,
        bias,
        labels,
        class_weight,
        lse,
        g_loss * row_coef,
        (g_loss + g_z) * row_coef,
        None if grad_entropy is None else grad_entropy.float(),
        None if grad_entropy is None else entropy,
        ctx.options,
        ctx.needs,
        u,
        b,
    )
    return _input_grads([g if need else None for g, need in zip(grads, ctx.needs, strict=True)])


_NO_INPUT_GRADS = (None,) * 6  # labels, class_weight, num_items, num_items_value, options, needs


def _input_grads(grads: list) -> tuple:
    """The gradients of hidden, weight, bias, u and B in ``flce``'s input order (None for an
    absent low-rank term)."""
    return (*grads[:3], *_NO_INPUT_GRADS, *grads[3:], *(None,) * (5 - len(grads)))


flce.register_autograd(_backward, setup_context=_setup_context)
