"""The fused op: the public functional and Module, its autograd formula, and the call that
checks the inputs, picks the backend and budget, and runs the chunks.

Gradient strategy. With reduction "mean"/"sum" the upstream gradient is one scalar, so the
forward computes the gradients at scale 1 while the logits chunk is hot, and the backward only
multiplies them by that scalar (the backend's ``scale_``; on Triton a kernel that reads it on
the device and does nothing when it is 1): three GEMMs per chunk in total. This is skipped for
fp16 (a GradScaler's factor must be applied before rounding to fp16, or small gradients
underflow) and whenever the backward needs something else (a gradient arriving through
``z_loss``, or a second backward over a retained graph); then the backward recomputes the
logits with exact per-row coefficients, which is also the path for reduction "none".

Every option arrives as one ``LossOptions``; how the work is chunked within the memory budget
is ``budget.plan_chunks``'s business, and ``chunked.run_chunks`` executes the plan.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from liger_patch.ops import budget, validation
from liger_patch.ops.backends import Backend, pick
from liger_patch.ops.chunked import run_chunks
from liger_patch.ops.options import (
    DEFAULT_OPTIONS,
    LossOptions,
    check_logits_dtype,
    options_docstring,
    options_parameters,
)
from liger_patch.ops.torch_ce import ce_rows_torch


@dataclass(frozen=True)
class _Run:
    """What the autograd Function carries besides tensors: the options, the backend record and
    the working budget in bytes."""

    opts: LossOptions
    backend: Backend
    budget: int


_NO_GRADS = (None,) * 4  # labels, row_weight, divisor, run


def _divisor(reduction: str, keep: torch.Tensor, num_items_in_batch: object) -> torch.Tensor | float:
    """What the summed loss is divided by. A zero divisor can only be right when nothing is kept
    (the sum is then 0), so it is replaced by 1: the loss is exactly 0, never NaN."""
    if reduction != "mean":
        return 1.0
    if num_items_in_batch is None:
        return keep.sum().clamp_min(1).float()
    if isinstance(num_items_in_batch, torch.Tensor):
        den = num_items_in_batch.to(device=keep.device, dtype=torch.float32).reshape(())
        return torch.where(den == 0, torch.ones_like(den), den)
    return float(num_items_in_batch) or 1.0


def _reduce(rows: torch.Tensor, reduction: str, divisor: torch.Tensor | float) -> torch.Tensor:
    """The rows reduced as ``reduction`` says (``divisor`` from ``_divisor``)."""
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / divisor


def _z_loss_rows(lse: torch.Tensor, opts: LossOptions) -> torch.Tensor:
    """``z_loss_scale * lse^2`` per row; exactly 0 without z-loss (``0 * lse^2`` would be NaN
    once lse^2 overflows fp32, at |lse| > 1.8e19, where the cross-entropy itself is finite)."""
    if opts.z_loss_scale == 0.0:
        return torch.zeros_like(lse)
    return opts.z_loss_scale * lse.square()


def _loss_and_z_loss(
    ce: torch.Tensor, lse: torch.Tensor, opts: LossOptions, divisor: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced ``ce + z_loss_scale * lse^2`` and its z-loss part (lse is 0 at ignored rows)."""
    z_rows = _z_loss_rows(lse, opts)
    return _reduce(ce + z_rows, opts.reduction, divisor), _reduce(z_rows, opts.reduction, divisor)


def _differentiable_grads(ctx, grad_loss, grad_z) -> tuple:
    """The input gradients as a graph of plain PyTorch ops, for ``create_graph=True``.

    A second derivative (a gradient penalty, a Hessian-vector product) needs the first one to be
    differentiable. This recomputes the loss densely in fp32 (the full ``tokens x vocab`` logits:
    the memory saving does not apply to this rarely used path) and lets autograd differentiate
    it, keeping the graph. The loss is ``sum_i row_weight_i (ce_i + zl_i)`` for every reduction
    (per row for "none"), as the forward computes it.
    """
    hidden, weight, bias, labels, row_weight, _ = ctx.saved_tensors
    opts = ctx.run.opts
    # Fresh views: when one input is a view of another (hidden = weight[:N]), autograd.grad with
    # respect to the inputs themselves would count the path through the other one twice.
    hidden, weight, bias = (None if t is None else t.view_as(t) for t in (hidden, weight, bias))
    needs = ctx.needs_input_grad[:3]
    inputs = [t for t, need in zip((hidden, weight, bias), needs, strict=True) if need]
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    ce, lse = ce_rows_torch(logits, labels, opts)
    z_rows = row_weight * _z_loss_rows(lse, opts)
    outputs, upstream = [], []
    for rows, grad in ((row_weight * ce + z_rows, grad_loss), (z_rows, grad_z)):
        if grad is not None and rows.requires_grad:
            outputs.append(rows if opts.reduction == "none" else rows.sum())
            upstream.append(grad)
    grads = [None] * len(inputs)
    if outputs:
        grads = torch.autograd.grad(outputs, inputs, upstream, create_graph=True, allow_unused=True)
    # Every input that asked for a gradient gets one, zeros where the loss does not reach it.
    found = iter(torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True))
    return (*(next(found) if need else None for need in needs), *_NO_GRADS)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, row_weight, divisor, run: _Run):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # Gradients in the forward, at scale 1, where one scalar will scale them (see module doc).
        precompute = run.opts.reduction != "none" and hidden.dtype != torch.float16
        coef = row_weight if precompute else None
        res = run_chunks(
            run.backend,
            hidden,
            weight,
            bias,
            labels,
            run.opts,
            budget_bytes=run.budget,
            coef_ce=coef,
            coef_z=coef,
            need_hidden=need_h,
            need_weight=need_w,
            need_bias=need_b and bias is not None,
        )
        loss, z_loss = _loss_and_z_loss(res.ce, res.lse, run.opts, divisor)

        ctx.save_for_backward(hidden, weight, bias, labels, row_weight, res.lse)
        ctx.pre = (res.grad_hidden, res.grad_weight, res.grad_bias) if precompute else None
        ctx.run = run
        ctx.set_materialize_grads(False)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z):
        if torch.is_grad_enabled():  # create_graph=True: a graph for a second derivative
            return _differentiable_grads(ctx, grad_loss, grad_z)
        hidden, weight, bias, labels, row_weight, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        run = ctx.run
        z_grad_matters = grad_z is not None and run.opts.z_loss_scale != 0.0
        if ctx.pre is not None and not z_grad_matters:
            grads = ctx.pre
            ctx.pre = None  # scaled in place below, so a second backward must recompute
            scale = grad_loss if grad_loss is not None else torch.zeros((), device=hidden.device)
            run.backend.scale_([g for g in grads if g is not None], scale)  # Triton: skipped at 1
            return (*grads, *_NO_GRADS)

        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        g_loss = zero if grad_loss is None else grad_loss.float()
        g_z = zero if grad_z is None else grad_z.float()
        with torch.autocast(hidden.device.type, enabled=False):
            res = run_chunks(
                run.backend,
                hidden,
                weight,
                bias,
                labels,
                run.opts,
                budget_bytes=run.budget,
                coef_ce=g_loss * row_weight,
                coef_z=(g_loss + g_z) * row_weight,
                lse_in=lse,
                need_hidden=need_h,
                need_weight=need_w,
                need_bias=need_b and bias is not None,
            )
        return res.grad_hidden, res.grad_weight, res.grad_bias, *_NO_GRADS


def _autocast_inputs(hidden, weight, bias):
    """Inside torch.autocast, cast like nn.Linear would; outside it, dtypes must already match."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    validation.check_dtypes_match(hidden, weight, bias)
    return hidden, weight, bias


def _fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LossOptions,
    num_items_in_batch: int | float | torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The op for checked options: check the tensors, pick backend and budget, run."""
    validation.check_num_items(num_items_in_batch, opts.reduction)
    validation.check_tensors(hidden, weight, labels, bias)
    budget_bytes = budget.working_bytes(opts.memory_budget, labels.numel())
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    check_logits_dtype(opts.logits_dtype, hidden.dtype)
    lead_shape = labels.shape
    h2d = hidden.reshape(labels.numel(), hidden.shape[-1])  # not (-1, H): H may be 0
    # Contiguous: kernels index labels by row (a strided or expanded view would be misread).
    flat_labels = labels.reshape(-1).long().contiguous()
    run = _Run(opts, pick(opts.backend, hidden.device), budget_bytes)

    keep = flat_labels != opts.ignore_index
    divisor = _divisor(opts.reduction, keep, num_items_in_batch)
    user_divisor = divisor if isinstance(num_items_in_batch, torch.Tensor) else None  # others checked already
    validation.check_values(flat_labels, weight.shape[0], opts.ignore_index, user_divisor)
    row_weight = keep.float() / divisor if opts.reduction == "mean" else keep.float()

    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    with torch.autocast(hidden.device.type, enabled=False):
        if wants_grad:
            loss, z_loss = _FusedLinearCrossEntropy.apply(
                h2d, weight, bias, flat_labels, row_weight, divisor, run
            )
        else:  # forward work only: no gradient buffers, no gradient pass
            res = run_chunks(run.backend, h2d, weight, bias, flat_labels, opts, budget_bytes=budget_bytes)
            loss, z_loss = _loss_and_z_loss(res.ce, res.lse, opts, divisor)
    if opts.reduction == "none":
        loss, z_loss = loss.reshape(lead_shape), z_loss.reshape(lead_shape)
    return (loss, z_loss) if opts.return_z_loss else loss


# torch.compile runs the op eagerly (a graph break). torch._disable_dynamo is torch.compiler.disable
# with torch._dynamo imported on the first call instead of at import: ~1 s off `import liger_patch`.
@torch._disable_dynamo
def fused_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    options: LossOptions = DEFAULT_OPTIONS,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    **overrides: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_linear_cross_entropy` with its options already built: ``options`` with
    ``overrides`` applied (checked here, inside the op, so a caller traced by ``torch.compile``
    builds nothing). The patched forward calls this."""
    options = options.replace(**overrides)
    return _fused(hidden, weight, labels, bias, options, num_items_in_batch)


@torch._disable_dynamo
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    **options: Any,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, never building the logits.

    Args:
        hidden: (..., H) last hidden states, fp32/bf16/fp16.
        weight: (V, H) output projection (``lm_head.weight``).
        labels: (...) integer class ids with the leading shape of ``hidden``; ``ignore_index``
            marks tokens that do not count.
        bias: optional (V,) output bias.
        num_items_in_batch: divisor for "mean" (int, int tensor or float tensor), as the HF Trainer
            passes it under gradient accumulation. 0 is allowed when nothing is kept.

    Options (keywords; one ``LossOptions``, docs/loss.md has the math):
        <OPTIONS>

    Every step after the GEMMs is fp32; gradients come back in the input dtypes, only for inputs
    that require them. When no token is kept the loss is exactly 0, still attached to the graph,
    and every input that requires grad receives a zero gradient. ``torch.compile`` runs this
    function eagerly (a graph break), which keeps its results identical to eager mode. A
    backward with ``create_graph=True`` (gradient penalties, Hessian-vector products) gives
    gradients that can be differentiated again; that path builds the full logits in fp32.
    """
    return _fused(hidden, weight, labels, bias, LossOptions.from_kwargs(**options), num_items_in_batch)


fused_linear_cross_entropy.__doc__ = fused_linear_cross_entropy.__doc__.replace(
    "        <OPTIONS>", options_docstring()
)
fused_linear_cross_entropy.__signature__ = inspect.Signature(
    [
        *list(inspect.signature(fused_linear_cross_entropy).parameters.values())[:5],
        *options_parameters(),
    ],
    return_annotation="torch.Tensor | tuple[torch.Tensor, torch.Tensor]",
)


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`, taking the same options.

    ``forward(hidden, weight, labels, bias=None, *, num_items_in_batch=None)``; a
    ``num_items_in_batch`` given to ``forward`` overrides the one given to the constructor (it
    usually changes every step). ``self.options`` is the ``LossOptions``.
    """

    def __init__(
        self, *, num_items_in_batch: int | float | torch.Tensor | None = None, **options: Any
    ) -> None:
        super().__init__()
        self.options = LossOptions.from_kwargs(where="FusedLinearCrossEntropyLoss", **options)
        validation.check_num_items(num_items_in_batch, self.options.reduction)
        self.num_items_in_batch = num_items_in_batch

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        num_items_in_batch: int | float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if num_items_in_batch is None:
            num_items_in_batch = self.num_items_in_batch
        return fused_loss(
            hidden, weight, labels, bias, options=self.options, num_items_in_batch=num_items_in_batch
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.changed().items())


FusedLinearCrossEntropyLoss.__init__.__signature__ = inspect.Signature(
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("num_items_in_batch", inspect.Parameter.KEYWORD_ONLY, default=None),
        *options_parameters(),
    ]
)
