"""Per-token log-probabilities of the labels, for RL (PPO, GRPO): ``fused_linear_logprobs``.

The same operator as the loss with reduction "none": log p(label) is minus the token's
cross-entropy, at a temperature T that divides the final logits (after any softcap, as TRL and
vLLM apply it): z = softcap(s * x) / T. That equals a softcap of c / T applied to (s / T) * x,
so the temperature folds exactly into the op's ``logit_scale`` and ``softcap`` options.
"""

from __future__ import annotations

import inspect
from collections import namedtuple
from typing import Any

import torch

from liger_patch.ops.core.final_logits import temperature_options
from liger_patch.ops.core.options import constant_changes
from liger_patch.ops.cross_entropy.functional import _fused
from liger_patch.ops.cross_entropy.options import (
    DEFAULT_OPTIONS,
    OptionKind,
    build_options,
    options_of_kind,
    options_parameters,
)

RUNTIME_OPTIONS = options_of_kind(OptionKind.RUNTIME)
"""The options a log-prob call takes as they are: how the op runs, never what it computes."""

LogProbs = namedtuple("LogProbs", ("logprobs", "entropy"))
"""``fused_linear_logprobs(..., return_entropy=True)``'s result: both per token."""


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float | None = None,
    **runtime: Any,
) -> torch.Tensor | LogProbs:
    """log p(labels) per token under softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature).

    Args:
        hidden: (..., H); weight: (V, H); labels: (...) int64 with hidden's leading shape;
            bias: optional (V,).
        temperature: T > 0 dividing the final logits (TRL's ``GRPOConfig.temperature``).
        return_entropy: also return the entropy of that softmax per token.
        ignore_index: label of tokens to skip: their log-prob and entropy are 0 (and get no gradient).
        softcap, logit_scale: as for :func:`fused_linear_cross_entropy`.
        runtime: every option of the runtime kind (how the op runs: ``backend``,
            ``memory_budget``, ``logits_dtype``, ``tuning``), as for :func:`fused_linear_cross_entropy`;
            the loss-math and output options are the log-prob's own above, any other is refused.

    Returns the log-probs in labels' shape (fp32, differentiable: ``-logprobs.sum().backward()`` is
    the cross-entropy's gradient), or ``LogProbs(logprobs, entropy)`` with ``return_entropy``;
    the entropy is differentiable too (an entropy bonus). The ``tokens x vocab`` logits are
    never built.
    """
    not_runtime = sorted(set(runtime) - set(RUNTIME_OPTIONS))
    if not_runtime:
        raise TypeError(
            f"fused_linear_logprobs got unknown option(s) {not_runtime}; besides temperature, "
            f"return_entropy, ignore_index, softcap and logit_scale it takes {list(RUNTIME_OPTIONS)}"
        )
    given = dict(
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        **runtime,
        **temperature_options(temperature, logit_scale, softcap),
    )
    opts = build_options(
        DEFAULT_OPTIONS.key, where="fused_linear_logprobs", reduction="none", **constant_changes(given)
    )
    out = _fused(hidden, weight, labels, bias, opts, None)
    if return_entropy:
        return LogProbs(-out.loss, out.entropy)
    return -out


_own = list(inspect.signature(fused_linear_logprobs).parameters.values())[:-1]  # without **runtime
fused_linear_logprobs.__signature__ = inspect.Signature(
    [*_own, *(p for p in options_parameters() if p.name in RUNTIME_OPTIONS)],
    return_annotation=inspect.signature(fused_linear_logprobs).return_annotation,
)
