"""Gradients computed in the forward, held by the autograd node, and scaled in the backward.

With reduction "mean" or "sum" a loss's upstream gradient is one scalar, so a forward may compute
its inputs' gradients at scale 1 while each chunk is hot and leave the backward only to multiply
them by that scalar (``grads_in_forward`` says when). The node holds them (``ForwardGrads``, not
saved tensors: the backward scales them in place, which a retained graph's version check would
refuse) and hands them over once; ``liger_patch::scale_grads_`` does the multiplication in place
on the backend the call ran (the Triton kernel reads the scalar on the device and does nothing
when it is 1). Every operator of both losses that computes gradients in its forward uses these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from liger_patch.ops.core.backends import pick
from liger_patch.ops.core.contexts import on_inputs_device
from liger_patch.ops.core.eager_call import EagerOp


def grads_in_forward(reduction: str, dtype: torch.dtype, needs: list[bool] | tuple[bool, ...]) -> bool:
    """Whether a forward computes the gradients while its chunks are hot: with reduction "mean" or
    "sum" (one scalar upstream gradient), unless the inputs are fp16 (a GradScaler's factor must
    be applied before the rounding to fp16, or small gradients underflow) or nothing wants a
    gradient."""
    return reduction != "none" and dtype != torch.float16 and any(needs)


@on_inputs_device
def _scale_grads(grads: list[Tensor], scale: Tensor, backend: str) -> None:
    """Multiplies the gradients the forward computed by the upstream gradient ``scale`` (0-d fp32),
    in place, with ``backend``'s ``scale_`` (the name ``backend=`` takes: fp32 product rounded
    once; Triton skips the work when it is 1)."""
    if grads:
        pick(backend, grads[0].device).scale_(grads, scale)


scale_grads_ = torch.library.custom_op("liger_patch::scale_grads_", _scale_grads, mutates_args=("grads",))


@scale_grads_.register_fake
def _scale_grads_fake(grads, scale, backend) -> None:
    return None


SCALE_GRADS = EagerOp(torch.ops.liger_patch.scale_grads_, _scale_grads)
"""``liger_patch::scale_grads_``, or its implementation where the call is plain eager."""


@dataclass
class ForwardGrads:
    """The gradients a forward computed at scale 1 (``None`` where not asked for), held by its
    autograd node until the backward takes them (``scaled``), once; ``spent`` after that."""

    grads: tuple[Tensor | None, ...] | None
    backend: str
    spent: bool = False

    @classmethod
    def held(cls, grads: tuple[Tensor | None, ...], needs: list[bool], backend: str) -> ForwardGrads:
        """The gradients of ``grads`` that ``needs`` asks for (the others are dropped), to be
        scaled with ``backend``'s kernel."""
        return cls(tuple(g if need else None for g, need in zip(grads, needs, strict=True)), backend)

    def scaled(self, grad_loss: Tensor | None) -> list[Tensor | None]:
        """The held gradients multiplied in place by the upstream gradient ``grad_loss`` (0 when
        ``None``: the loss was not used); they are the caller's from now on."""
        grads, self.grads, self.spent = self.grads, None, True
        present = [g for g in grads if g is not None]
        if present:
            scale = grad_loss if grad_loss is not None else torch.zeros((), device=present[0].device)
            SCALE_GRADS(present, scale.float(), self.backend)
        return list(grads)


def spent_error(op: str) -> RuntimeError:
    """What a second backward over a retained graph gets from an op that computed its gradients in
    the forward and kept nothing else."""
    return RuntimeError(
        f"{op} computed its gradients in the forward and kept nothing else; a second backward over a "
        "retained graph needs reduction='none' (which recomputes them)"
    )
