"""Gradients computed in the forward, and the registered operator that scales them in the backward.

With reduction "mean" or "sum" a loss's upstream gradient is one scalar, so a forward may compute
its inputs' gradients at scale 1 while each chunk is hot and leave the backward only to multiply
them by that scalar (``grads_in_forward`` says when). ``liger_patch::scale_grads_`` does that
multiplication in place, on the backend the call ran (the Triton kernel reads the scalar on the
device and does nothing when it is 1): both losses' backward call it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from liger_patch.ops.core.backends import pick


def grads_in_forward(reduction: str, dtype: torch.dtype, needs: list[bool] | tuple[bool, ...]) -> bool:
    """Whether a forward computes the gradients while its chunks are hot: with reduction "mean" or
    "sum" (one scalar upstream gradient), unless the inputs are fp16 (a GradScaler's factor must
    be applied before the rounding to fp16, or small gradients underflow) or nothing wants a
    gradient."""
    return reduction != "none" and dtype != torch.float16 and any(needs)


@torch.library.custom_op("liger_patch::scale_grads_", mutates_args=("grads",))
def scale_grads_(grads: list[Tensor], scale: Tensor, backend: str) -> None:
    """Multiplies the gradients the forward computed by the upstream gradient ``scale`` (0-d fp32),
    in place, with ``backend``'s ``scale_`` (the name ``backend=`` takes: fp32 product rounded
    once; Triton skips the work when it is 1)."""
    if grads:
        pick(backend, grads[0].device).scale_(grads, scale)


@scale_grads_.register_fake
def _scale_grads_fake(grads, scale, backend) -> None:
    return None
