"""A head's final logits: z = softcap(s * x) of its raw logits x = W h + b, and what the losses'
gradients need of that map, d z / d x (docs/loss.md, docs/distillation.md): one statement for the
cross-entropy's and the distillation's PyTorch row math.

Every loss describes its heads' logits with options that have ``logit_scale`` (s, ``None``: 1),
``softcap`` (c, ``None``: none), ``label_smoothing`` (whether the fused logits GEMM also sums z
per tile) and ``tuning`` (:class:`LogitsOptions`): the cross-entropy's ``LossOptions``, each
side's ``SideOptions`` of the distillation. The shared chunk machinery (``gemm``, ``head_start``,
``triton/logits.py``) reads nothing else of them.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from liger_patch.ops.core.options import option_float
from liger_patch.ops.core.tuning import Tuning


class LogitsOptions(Protocol):
    """What the shared machinery reads of a loss's options for one head's logits."""

    logit_scale: float | None
    softcap: float | None
    label_smoothing: float
    tuning: Tuning

    @property
    def scale(self) -> float:
        """The logit multiplier as a number (1 without ``logit_scale``)."""


def final_logits(logits: torch.Tensor, opts: LogitsOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z = softcap(s * x) in fp32, and u = s * x / c (for the softcap's derivative) or None."""
    x = logits.float()
    if opts.logit_scale is not None:
        x = x * opts.scale
    if opts.softcap is None:
        return x, None
    u = x / opts.softcap
    return opts.softcap * torch.tanh(u), u


def softcap_slope_(u: torch.Tensor) -> torch.Tensor:
    """d tanh(u) / du = 1 - tanh(u)^2 for ``final_logits``' u, in u's buffer, as 4e / (1 + e)^2
    with e = exp(-2|u|): no cancellation once tanh saturates (as the Triton kernels write it)."""
    e = u.abs_().mul_(-2.0).exp_()
    denominator = (e + 1.0).square_()
    return e.mul_(4.0).div_(denominator)


def to_raw_logits_(g: torch.Tensor, slope: torch.Tensor | None, opts: LogitsOptions) -> torch.Tensor:
    """A gradient with respect to the final logits z = softcap(s x), made one with respect to the
    raw logits x in place: times the softcap's ``slope`` (``softcap_slope_``; ``None`` without a
    softcap), then times s."""
    if slope is not None:
        g.mul_(slope)
    if opts.logit_scale is not None:
        g.mul_(opts.scale)
    return g


def temperature_options(temperature: float, logit_scale: float | None, softcap: float | None) -> dict:
    """``logit_scale`` and ``softcap`` with a temperature T folded in: c tanh(s x / c) / T is
    (c/T) tanh((s/T) x / (c/T)), so the final logits at a temperature are final logits with
    these options (``fused_linear_logprobs``, each side of the distillation)."""
    t = option_float("temperature", temperature)
    if not (math.isfinite(t) and t > 0.0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if t == 1.0:
        return {"logit_scale": logit_scale, "softcap": softcap}
    scale = 1.0 if logit_scale is None else option_float("logit_scale", logit_scale)
    return {
        "logit_scale": scale / t,
        "softcap": None if softcap is None else option_float("softcap", softcap) / t,
    }
