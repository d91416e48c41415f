"""Fused knowledge distillation: ``fused_linear_distillation`` and ``FusedLinearDistillationLoss``.

The student's and the teacher's ``tokens x V`` logits are never built: the registered operator
``liger_patch::fused_distill`` (``distillation_operator.py``) walks the kept tokens in chunks
within the memory budget. This module checks the tensors (each side as the cross-entropy op
checks its own, then the pair), applies autocast as ``nn.Linear`` would, and calls it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from liger_patch.ops.core import validation
from liger_patch.ops.core.options import constant_changes, keyword_parameters
from liger_patch.ops.core.tuning import DEFAULT_TUNING, Tuning
from liger_patch.ops.distillation import operator
from liger_patch.ops.distillation.options import (
    DISTILL_OPTION_NAMES,
    DistillOptions,
    build_distill_options,
    distill_options_docstring,
    distill_options_from_key,
)

NumItems = int | float | Tensor | None
HeadTensors = tuple[Tensor, Tensor, Tensor | None]
"""One side's (hidden, weight, bias)."""


def _checked_side(
    side: str, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One side's tensors checked as the cross-entropy op checks its own (the message says which
    side), then cast as autocast casts an ``nn.Linear``'s inputs."""
    try:
        validation.check_tensors(hidden, weight, labels, bias)
        return validation.autocast_inputs(hidden, weight, bias)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{side}: {exc}") from None


def _check_pair(
    student_weight: Tensor, teacher_weight: Tensor, student_hidden: Tensor, teacher_hidden: Tensor
):
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"vocabulary mismatch: student_weight has V={student_weight.shape[0]} rows (shape "
            f"{tuple(student_weight.shape)}) but teacher_weight has V={teacher_weight.shape[0]} (shape "
            f"{tuple(teacher_weight.shape)}); distillation compares the two softmaxes over one vocabulary"
        )
    if student_hidden.device != teacher_hidden.device:
        raise ValueError(
            f"the student's tensors are on {student_hidden.device} but the teacher's on "
            f"{teacher_hidden.device}; put both on one device"
        )


def flat_operands(
    student: HeadTensors, teacher: HeadTensors, labels: Tensor, num_items_in_batch: NumItems
) -> tuple:
    """The leading operands of a distillation operator, from checked tensors: each side's hidden
    states as (N, H) (not (-1, H): N may be 0), weight and bias, the labels as (N,), and
    ``num_items_in_batch`` as the operators take it, a tensor or a float (the other ``None``)."""
    (sh, sw, sb), (th, tw, tb) = student, teacher
    n = labels.numel()
    return (
        sh.reshape(n, sh.shape[-1]),
        sw,
        sb,
        th.reshape(n, th.shape[-1]),
        tw,
        tb,
        labels.reshape(-1),
        *validation.num_items_operands(num_items_in_batch),
    )


def _distill(
    student: HeadTensors,
    teacher: HeadTensors,
    labels: Tensor,
    opts: DistillOptions,
    num_items_in_batch: NumItems,
) -> Tensor:
    """The loss for checked options: check the tensors, call the operator, shape the result."""
    validation.check_num_items(num_items_in_batch, opts.reduction)
    sh, sw, sb = _checked_side("student", student[0], student[1], labels, student[2])
    th, tw, tb = _checked_side("teacher", teacher[0], teacher[1], labels, teacher[2])
    _check_pair(sw, tw, sh, th)
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and t is not None and t.requires_grad for t in (sh, sw, sb)]
    operands = flat_operands((sh, sw, sb), (th, tw, tb), labels, num_items_in_batch)
    loss, *_ = operator.FUSED_DISTILL(*operands, opts.key, needs)
    return loss.reshape(labels.shape) if opts.reduction == "none" else loss


def fused_linear_distillation(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    labels: Tensor,
    student_bias: Tensor | None = None,
    teacher_bias: Tensor | None = None,
    *,
    beta: float = 0.0,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: NumItems = None,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    student_logit_scale: float | None = None,
    teacher_logit_scale: float | None = None,
    backend: str = "auto",
    memory_budget: int | str | None = None,
    logits_dtype: torch.dtype | None = None,
    tuning: Tuning | None = None,
) -> Tensor:
    """Distillation loss of ``student_hidden @ student_weight.T (+ student_bias)`` towards
    ``teacher_hidden @ teacher_weight.T (+ teacher_bias)``, never building either's logits.

    TRL's generalized JSD (``GKDTrainer.generalized_jsd_loss``, ``DistillationTrainer``): both
    sides' final logits (logit scale, then softcap) divided by ``temperature``; per kept token the
    divergence summed over the vocabulary, mixed with the student's cross-entropy by ``ce_weight``.

    Args:
        student_hidden: (..., H_s) fp32/bf16/fp16; student_weight: (V, H_s); student_bias: (V,).
        teacher_hidden: (..., H_t) with the student's leading shape; teacher_weight: (V, H_t) (the
            same V; H_t may differ from H_s); teacher_bias: (V,).
        labels: (...) integer ids with the hidden states' leading shape; ``ignore_index`` marks
            tokens that count for nothing (the cross-entropy's targets when ``ce_weight`` > 0).
        num_items_in_batch: divisor for "mean" (int, int tensor or float tensor), as the HF
            Trainer passes it under gradient accumulation. 0 is allowed when nothing is kept.

    Options:
        <OPTIONS>

    Returns the loss (fp32): a scalar, or per token in labels' shape for reduction "none" (0
    at ignored tokens). Gradients flow to the student's hidden states, weight and bias only, in
    their dtypes; the teacher's tensors get none even when they require grad (they may be
    frozen parameters or inference tensors). When no token is kept the loss is exactly 0 and
    every student input that requires grad gets a zero gradient. The op is the registered
    operator ``torch.ops.liger_patch.fused_distill``: ``torch.compile(fullgraph=True)`` captures
    it as one node. There is no second derivative (``create_graph=True`` is refused).
    """
    opts = build_distill_options(
        **constant_changes(
            dict(
                beta=beta,
                temperature=temperature,
                ce_weight=ce_weight,
                ignore_index=ignore_index,
                reduction=reduction,
                student_softcap=student_softcap,
                teacher_softcap=teacher_softcap,
                student_logit_scale=student_logit_scale,
                teacher_logit_scale=teacher_logit_scale,
                backend=backend,
                memory_budget=memory_budget,
                logits_dtype=logits_dtype,
                tuning=DEFAULT_TUNING if tuning is None else tuning,
            )
        )
    )
    student = (student_hidden, student_weight, student_bias)
    return _distill(student, (teacher_hidden, teacher_weight, teacher_bias), labels, opts, num_items_in_batch)


fused_linear_distillation.__doc__ = fused_linear_distillation.__doc__.replace(
    "        <OPTIONS>", distill_options_docstring()
)


class FusedLinearDistillationLoss(torch.nn.Module):
    """Module form of :func:`fused_linear_distillation`, taking the same options.

    ``forward(student_hidden, student_weight, teacher_hidden, teacher_weight, labels,
    student_bias=None, teacher_bias=None, *, num_items_in_batch=None)``; a ``num_items_in_batch``
    given to ``forward`` overrides the constructor's. ``self.options`` is the ``DistillOptions``.
    """

    def __init__(self, *, num_items_in_batch: NumItems = None, **options: Any) -> None:
        super().__init__()
        self.options = build_distill_options(where="FusedLinearDistillationLoss", **options)
        validation.check_num_items(num_items_in_batch, self.options.reduction)
        self.num_items_in_batch = num_items_in_batch

    def forward(
        self,
        student_hidden: Tensor,
        student_weight: Tensor,
        teacher_hidden: Tensor,
        teacher_weight: Tensor,
        labels: Tensor,
        student_bias: Tensor | None = None,
        teacher_bias: Tensor | None = None,
        *,
        num_items_in_batch: NumItems = None,
    ) -> Tensor:
        if num_items_in_batch is None:
            num_items_in_batch = self.num_items_in_batch
        options = distill_options_from_key(self.options.key)  # a constant under torch.compile
        student = (student_hidden, student_weight, student_bias)
        teacher = (teacher_hidden, teacher_weight, teacher_bias)
        return _distill(student, teacher, labels, options, num_items_in_batch)

    def extra_repr(self) -> str:
        defaults = DistillOptions()
        return ", ".join(
            f"{name}={getattr(self.options, name)!r}"
            for name in DISTILL_OPTION_NAMES
            if getattr(self.options, name) != getattr(defaults, name)
        )


FusedLinearDistillationLoss.__init__.__signature__ = inspect.Signature(
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("num_items_in_batch", inspect.Parameter.KEYWORD_ONLY, default=None),
        *keyword_parameters(DistillOptions),
    ]
)
