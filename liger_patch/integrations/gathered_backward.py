"""The fused op on a head whose tensors are whole only inside a gathering context, its backward
run inside that context again: DeepSpeed ZeRO-3 under TRL's fused LM head.

TRL calls its log-prob kernel inside ``maybe_gather_lm_head_ctx(weight, bias)`` (DeepSpeed's
``GatheredParameters``). When the context exits, DeepSpeed frees the gathered head
(``param.data = torch.empty(0)``), so an op that saves the weight for its backward finds an empty
partition there; TRL's own kernel enters the context again in its backward. :class:`GatheredBackward`
gives the fused op that second gathering without the op knowing of it:

* forward: the op runs on *stand-ins*, fresh leaves holding the inputs' data (the head's as
  gathered now), and its graph is kept inside this node. The head's stand-ins then let go of the
  gathered storage (their ``.data`` set empty, as DeepSpeed does to the parameter), so nothing
  holds it past the caller's context, and DeepSpeed may free or reuse it;
* backward: inside ``gather(weight, bias)`` entered again, the head's stand-ins take the data
  gathered anew, the op's own backward runs over the kept graph (``torch.autograd.grad``), and
  the stand-ins let go again before the context exits.

The gradients leave through this node's edges to the head's parameters, so they reach each
parameter's ``AccumulateGrad`` (where DeepSpeed's reduce hooks fire) once, as TRL's kernel's do;
the inner graph ends at the stand-ins, whose hooks are none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["GatheredBackward"]

Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Sequence[torch.Tensor | None]]
Gather = Callable[[torch.Tensor, torch.Tensor | None], AbstractContextManager]


class GatheredBackward(torch.autograd.Function):
    """``GatheredBackward.apply(compute, gather, hidden, weight, bias)``: ``compute(hidden, weight,
    bias)``'s outputs (tensors or ``None``), differentiable as ``compute``'s own, with the backward
    run inside ``gather(weight, bias)``. Call it inside that context (the head gathered)."""

    @staticmethod
    def forward(ctx: Any, compute: Compute, gather: Gather, *inputs: torch.Tensor | None) -> tuple:
        stand_ins = tuple(None if t is None else t.detach().requires_grad_(t.requires_grad) for t in inputs)
        try:
            with torch.enable_grad():
                outs = tuple(compute(*stand_ins))
        finally:
            _let_go(stand_ins[1:])
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*inputs[1:])
        ctx.gather, ctx.stand_ins, ctx.outs = gather, stand_ins, outs
        ctx.head_shapes = tuple(None if t is None else t.shape for t in inputs[1:])
        results = tuple(None if o is None else o.detach() for o in outs)
        ctx.mark_non_differentiable(
            *(r for r, o in zip(results, outs, strict=True) if r is not None and not o.requires_grad)
        )
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        if ctx.outs is None:
            raise RuntimeError(
                "liger_patch: the fused log-prob head under a gathering context (DeepSpeed ZeRO-3) frees "
                "its graph in its first backward; it cannot be run backward a second time."
            )
        outs, ctx.outs = ctx.outs, None  # the kept graph goes with this backward
        head = ctx.saved_tensors
        with ctx.gather(*head):
            _take_gathered(ctx.stand_ins[1:], head, ctx.head_shapes)
            try:
                found = _inner_grads(outs, grads, ctx.stand_ins)
            finally:
                _let_go(ctx.stand_ins[1:])
        return (None, None, *found)


def _let_go(stand_ins: Sequence[torch.Tensor | None]) -> None:
    """Drop the stand-ins' hold on the head's gathered storage."""
    for stand_in in stand_ins:
        if stand_in is not None:
            stand_in.data = torch.empty(0, dtype=stand_in.dtype, device=stand_in.device)


def _take_gathered(
    stand_ins: Sequence[torch.Tensor | None],
    head: Sequence[torch.Tensor | None],
    shapes: Sequence[torch.Size | None],
) -> None:
    """Point the stand-ins at the head's data gathered for this backward (checked whole)."""
    for stand_in, tensor, shape in zip(stand_ins, head, shapes, strict=True):
        if stand_in is None:
            continue
        if tensor.shape != shape:
            raise RuntimeError(
                f"liger_patch: a head tensor of shape {tuple(shape)} in the forward has shape "
                f"{tuple(tensor.shape)} inside the gathering context of the backward: it was not gathered."
            )
        stand_in.data = tensor.data


def _inner_grads(
    outs: Sequence[torch.Tensor | None],
    grads: Sequence[torch.Tensor | None],
    stand_ins: Sequence[torch.Tensor | None],
) -> tuple[torch.Tensor | None, ...]:
    """The kept graph's gradients for every stand-in that requires one; zeros where none reaches
    it (as TRL's kernel gives, so every parameter's reduce hook fires on every rank)."""
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o is not None and g is not None]
    pairs = [(o, g) for o, g in pairs if o.requires_grad]
    wanted = [t for t in stand_ins if t is not None and t.requires_grad]
    found: Sequence[torch.Tensor | None] = [None] * len(wanted)
    if pairs and wanted:
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        )  # fmt: skip
    filled = iter(torch.zeros_like(t) if g is None else g for g, t in zip(found, wanted, strict=True))
    return tuple(next(filled) if t is not None and t.requires_grad else None for t in stand_ins)
