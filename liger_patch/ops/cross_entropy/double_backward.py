"""The op's gradients as a graph of plain PyTorch ops, for a backward with ``create_graph=True``
(``autograd.py``'s formula hands this path over when grad mode is on in its backward)."""

from __future__ import annotations

import torch
from torch import Tensor

from liger_patch.ops.core.final_logits import final_logits
from liger_patch.ops.cross_entropy.forward_io import SavedTensors
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ChunkRecords, ClassWeight
from liger_patch.ops.cross_entropy.rows import ce_rows_torch, row_entropy, z_loss_rows


def differentiable_grads(
    saved: SavedTensors,
    opts: LossOptions,
    needs: list[bool],
    class_weight: ClassWeight | None,
    grad_loss: Tensor | None,
    grad_z: Tensor | None,
    grad_entropy: Tensor | None,
) -> list[Tensor | None]:
    """The input gradients as a graph of plain PyTorch ops, for ``create_graph=True``.

    A second derivative (a gradient penalty, a Hessian-vector product) needs the first one to be
    differentiable. This recomputes the loss densely in fp32 (the full ``tokens x vocab`` logits:
    the memory saving does not apply to this rarely used path) and lets autograd differentiate
    it, keeping the graph. The loss is ``sum_i row_weight_i (ce_i + zl_i)`` for every reduction
    (per row for "none"), as the forward computes it; the entropy's rows are recomputed too.

    ``saved``: what the forward's node saved (u and B ``None`` without a low-rank term); returns the
    gradients of hidden, weight, bias (u, B) that ``needs`` asks for, ``None`` for the others.
    """
    labels, row_weight, token_scale = saved.labels, saved.row_weight, saved.token_scale
    # Fresh views: when one input is a view of another (hidden = weight[:N]), autograd.grad with
    # respect to the inputs themselves would count the path through the other one twice.
    tensors = [
        None if t is None else t.view_as(t)
        for t in (saved.hidden, saved.weight, saved.bias, saved.u, saved.b)
    ]
    hidden, weight, bias, u, b = tensors
    needs = needs[: 3 if u is None else 5]
    inputs = [t for t, need in zip(tensors, needs, strict=False) if need]
    logits = hidden.float() @ weight.to(hidden.dtype).float().t()  # rounded as the forward's GEMMs
    if u is not None:
        logits = logits + u.float() @ b.float().t()
    if bias is not None:
        logits = logits + bias.float()
    labels = labels.long()
    ce, lse = ce_rows_torch(logits, labels, opts, records=ChunkRecords(class_weight=class_weight))
    if opts.use_token_scaling:
        row_weight = row_weight * token_scale
    z_rows = row_weight * z_loss_rows(lse, opts)
    outputs, upstream = [], []
    for rows, grad in ((row_weight * ce + z_rows, grad_loss), (z_rows, grad_z)):
        if grad is not None and rows.requires_grad:
            outputs.append(rows if opts.reduction == "none" else rows.sum())
            upstream.append(grad)
    if grad_entropy is not None:
        z, _ = final_logits(logits, opts)
        outputs.append(row_entropy(z, lse, labels != opts.ignore_index))
        upstream.append(grad_entropy)
    grads = [None] * len(inputs)
    if outputs:
        grads = torch.autograd.grad(outputs, inputs, upstream, create_graph=True, allow_unused=True)
    # Every input that asked for a gradient gets one, zeros where the loss does not reach it.
    found = iter(torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True))
    return [next(found) if need else None for need in needs]
