"""The autograd formula of ``liger_patch::flce`` (``operator.py``): what the node keeps, and which
of three backward paths a backward takes.

* The gradients the forward computed (``core/forward_grads.py``), scaled by the upstream
  gradient: reduction "mean"/"sum", no gradient through ``z_loss`` or the entropy, the first
  backward only (the node holds them no longer after it).
* ``liger_patch::flce_backward``: logits recomputed with exact per-row coefficients, from the
  tensors the node saved.
* A backward with ``create_graph=True``: the gradients as a graph of plain PyTorch ops
  (``double_backward.py``), so that they can be differentiated again.
"""

from __future__ import annotations

import torch
from torch import Tensor

from liger_patch.ops.core.forward_grads import ForwardGrads, grads_in_forward
from liger_patch.ops.cross_entropy.double_backward import differentiable_grads
from liger_patch.ops.cross_entropy.forward_io import (
    ForwardInputs,
    ForwardOutputs,
    SavedTensors,
    low_rank_needs,
)
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.recompute import FLCE_BACKWARD
from liger_patch.ops.cross_entropy.row_io import ClassWeight

_F32 = torch.float32


def setup_context(ctx, inputs, output) -> None:
    args, out = ForwardInputs(*inputs), ForwardOutputs(*output)
    opts = LossOptions.from_key(args.options)
    ctx.set_materialize_grads(False)  # an output nobody used gives None, not zeros to compute with
    grads = (out.grad_hidden, out.grad_weight, out.grad_bias, out.grad_u, out.grad_b)
    ctx.mark_non_differentiable(out.argmax, out.lse, out.row_weight, out.token_scale, *grads)
    if not opts.return_entropy:
        ctx.mark_non_differentiable(out.entropy)
    ctx.save_for_backward(
        *SavedTensors(
            args.hidden, args.weight, args.bias, args.labels, args.class_weight, out.lse, out.row_weight,
            out.token_scale, out.entropy, args.low_rank_u, args.low_rank_b,
        )
    )  # fmt: skip
    ctx.options, ctx.needs = args.options, [*args.needs[:3], *low_rank_needs(args.needs)]
    ctx.forward_grads = None  # a second backward recomputes, once the first took them
    if grads_in_forward(opts.reduction, args.hidden.dtype, args.needs):
        ctx.forward_grads = ForwardGrads.held(grads, ctx.needs, opts.backend)
    ctx.head_shapes = _shapes(args.weight, args.bias)


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


def backward(ctx, grad_loss, grad_z, _grad_argmax, grad_entropy, *_no_grads):
    opts = LossOptions.from_key(ctx.options)
    if torch.is_grad_enabled():  # create_graph=True: a graph for a second derivative
        saved = SavedTensors(*ctx.saved_tensors)
        _check_head_whole(ctx, saved.weight, saved.bias)
        cw = ClassWeight.of(saved.class_weight)
        return _input_grads(differentiable_grads(saved, opts, ctx.needs, cw, grad_loss, grad_z, grad_entropy))
    z_grad_matters = grad_z is not None and opts.z_loss_scale != 0.0
    # Whichever way this backward goes, the node holds the forward's gradients no longer (they
    # are scaled in place below, or not needed): a second backward recomputes.
    held, ctx.forward_grads = ctx.forward_grads, None
    if held is not None and not z_grad_matters and grad_entropy is None:
        # The saved tensors are not unpacked here: each unpack is host time, and nothing reads them.
        return _input_grads(held.scaled(grad_loss))
    saved = SavedTensors(*ctx.saved_tensors)
    _check_head_whole(ctx, saved.weight, saved.bias)
    return _input_grads(_recomputed(ctx, saved, opts, grad_loss, grad_z, grad_entropy))


def _recomputed(ctx, saved: SavedTensors, opts: LossOptions, grad_loss, grad_z, grad_entropy) -> list:
    """``liger_patch::flce_backward``'s gradients, with each row's coefficients of d ce, d z-loss
    and d entropy from the upstream gradients."""
    zero = torch.zeros((), dtype=_F32, device=saved.hidden.device)
    g_loss = zero if grad_loss is None else grad_loss.float()
    g_z = zero if grad_z is None else grad_z.float()
    row_coef = saved.row_weight * saved.token_scale if opts.use_token_scaling else saved.row_weight
    grads = FLCE_BACKWARD(
        saved.hidden,
        saved.weight,
        saved.bias,
        saved.labels,
        saved.class_weight,
        saved.lse,
        g_loss * row_coef,
        (g_loss + g_z) * row_coef,
        None if grad_entropy is None else grad_entropy.float(),
        None if grad_entropy is None else saved.entropy,
        ctx.options,
        ctx.needs,
        saved.u,
        saved.b,
    )
    return [g if need else None for g, need in zip(grads, ctx.needs, strict=True)]


_NO_INPUT_GRADS = (None,) * 6  # labels, class_weight, num_items, num_items_value, options, needs


def _input_grads(grads: list) -> tuple:
    """The gradients of hidden, weight, bias, u and B in ``flce``'s input order (None for an
    absent low-rank term)."""
    return (*grads[:3], *_NO_INPUT_GRADS, *grads[3:], *(None,) * (5 - len(grads)))
