"""``fused_linear_cross_entropy``: the public op, its autograd.Function and backend dispatch.

Gradient strategy. With reduction "mean"/"sum" the upstream gradient is one scalar, so the
forward computes the gradients at scale 1 while the logits chunk is hot, and the backward only
multiplies them by that scalar (on Triton, a kernel that reads it on the device and does nothing
when it is 1): three GEMMs per chunk in total. This is skipped for fp16 (a
GradScaler's factor must be applied before rounding to fp16, or small gradients underflow) and
whenever the backward needs something else (a gradient arriving through ``z_loss``, or a second
backward over a retained graph); then the backward recomputes the logits with exact per-row
coefficients, which is also the path for reduction "none".

How the work is chunked, within ``memory_budget``, is ``chunked.run_chunks``'s business.
"""

from __future__ import annotations

from typing import Literal

import torch

from liger_patch import env
from liger_patch.ops import validation
from liger_patch.ops.chunked import RowKernel, run_chunks
from liger_patch.ops.budget import parse_memory_budget
from liger_patch.ops.options import LossOptions
from liger_patch.ops.torch_ce import ce_rows_torch

DEFAULT_MEMORY_BUDGET: int | str = "default"
"""The budget a call uses when it passes none and ``LIGER_MEMORY_BUDGET`` is unset (see
``options.MEMORY_BUDGETS``): 512 MiB."""

Reduction = Literal["mean", "sum", "none"]
Backend = Literal["auto", "triton", "torch"]


def resolve_memory_budget(memory_budget: int | str | None) -> int:
    """Bytes of the budget: the argument, else ``LIGER_MEMORY_BUDGET`` (read now), else the default."""
    if memory_budget is not None:
        return parse_memory_budget(memory_budget)
    from_env = env.memory_budget()
    if from_env is None:
        return parse_memory_budget(DEFAULT_MEMORY_BUDGET)
    try:
        return parse_memory_budget(from_env)
    except ValueError as exc:
        raise ValueError(f"environment variable LIGER_MEMORY_BUDGET={from_env!r}: {exc}") from None


PER_TOKEN_BYTES = 32
"""Per-token vectors the op keeps beside its chunks (labels, masks, row weights, loss terms)."""
SLACK_BYTES = 2 << 20
"""Allocator rounding and cuBLAS workspace seen beside the chunks on an H200 (about 1 MiB)."""


def _working_budget(budget: int, n_tokens: int) -> int:
    """What the chunk buffers may use: the budget less the per-token vectors and the slack, so
    that everything the op allocates stays inside ``memory_budget`` (at least one row is kept)."""
    return max(1, budget - PER_TOKEN_BYTES * n_tokens - SLACK_BYTES)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend that runs: "auto" takes Triton on CUDA or under TRITON_INTERPRET=1, else torch."""
    usable = device.type == "cuda" or env.triton_interpret()
    if backend == "auto":
        return "triton" if usable and _triton_available() else "torch"
    if backend == "triton":
        if not _triton_available():
            raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
        if not usable:
            raise ValueError(
                f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for tensors on {device.type}; "
                "use backend='torch' or 'auto'"
            )
    return backend


def _row_kernel(backend: str) -> RowKernel:
    if backend == "triton":
        from liger_patch.ops.triton_ce import ce_rows_triton

        return ce_rows_triton
    return ce_rows_torch


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
    ce: torch.Tensor, lse: torch.Tensor, opts: LossOptions, reduction: str, divisor: torch.Tensor | float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduced ``ce + z_loss_scale * lse^2`` and its z-loss part (lse is 0 at ignored rows)."""
    z_rows = _z_loss_rows(lse, opts)
    return _reduce(ce + z_rows, reduction, divisor), _reduce(z_rows, reduction, divisor)


def _differentiable_grads(ctx, grad_loss, grad_z) -> tuple:
    """The input gradients as a graph of plain PyTorch ops, for ``create_graph=True``.

    A second derivative (a gradient penalty, a Hessian-vector product) needs the first one to be
    differentiable. This recomputes the loss densely in fp32 (the full ``tokens x vocab`` logits:
    the memory saving does not apply to this rarely used path) and lets autograd differentiate
    it, keeping the graph. The loss is ``sum_i row_weight_i (ce_i + zl_i)`` for every reduction
    (per row for "none"), as the forward computes it.
    """
    hidden, weight, bias, labels, row_weight, _ = ctx.saved_tensors
    # Fresh views: when one input is a view of another (hidden = weight[:N]), autograd.grad with
    # respect to the inputs themselves would count the path through the other one twice.
    hidden, weight, bias = (None if t is None else t.view_as(t) for t in (hidden, weight, bias))
    needs = ctx.needs_input_grad[:3]
    inputs = [t for t, need in zip((hidden, weight, bias), needs, strict=True) if need]
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    ce, lse = ce_rows_torch(logits, labels, ctx.opts)
    z_rows = row_weight * _z_loss_rows(lse, ctx.opts)
    outputs, upstream = [], []
    for rows, grad in ((row_weight * ce + z_rows, grad_loss), (z_rows, grad_z)):
        if grad is not None and rows.requires_grad:
            outputs.append(rows if ctx.reduction == "none" else rows.sum())
            upstream.append(grad)
    grads = [None] * len(inputs)
    if outputs:
        grads = torch.autograd.grad(outputs, inputs, upstream, create_graph=True, allow_unused=True)
    # Every input that asked for a gradient gets one, zeros where the loss does not reach it.
    found = iter(torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs, strict=True))
    return (*(next(found) if need else None for need in needs), *[None] * 8)


_SCALE_SLICE = 1 << 22
"""Elements scaled per step by ``_scale_in_fp32_`` (a 16 MiB fp32 temporary)."""


def _scale_in_fp32_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply contiguous tensors in place by the 0-d fp32 ``scale``: the fp32 product rounded
    once, as the Triton scaling kernel does. (``mul_`` of a bf16 tensor by a 0-d CUDA tensor
    rounds the scale to bf16 first: 0.37 became 0.3691, a bias of up to 0.4 %.)"""
    for t in tensors:
        if t.dtype == torch.float32:
            t.mul_(scale)
            continue
        flat = t.view(-1)
        for start in range(0, flat.numel(), _SCALE_SLICE):
            part = flat[start : start + _SCALE_SLICE]
            part.copy_(part.float().mul_(scale))


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, row_weight, divisor, opts, reduction, backend, budget, logits_dtype
    ):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        kernel = _row_kernel(backend)
        # Gradients in the forward, at scale 1, where one scalar will scale them (see module doc).
        precompute = reduction != "none" and hidden.dtype != torch.float16
        coef = row_weight if precompute else None
        res = run_chunks(
            kernel,
            hidden,
            weight,
            bias,
            labels,
            opts,
            budget_bytes=budget,
            coef_ce=coef,
            coef_z=coef,
            need_hidden=need_h,
            need_weight=need_w,
            need_bias=need_b and bias is not None,
            logits_dtype=logits_dtype,
            fused_logits=backend == "triton",
        )
        loss, z_loss = _loss_and_z_loss(res.ce, res.lse, opts, reduction, divisor)

        ctx.save_for_backward(hidden, weight, bias, labels, row_weight, res.lse)
        ctx.pre = (res.grad_hidden, res.grad_weight, res.grad_bias) if precompute else None
        ctx.opts, ctx.reduction, ctx.backend, ctx.budget = opts, reduction, backend, budget
        ctx.logits_dtype = logits_dtype
        ctx.set_materialize_grads(False)
        return loss, z_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_z):
        if torch.is_grad_enabled():  # create_graph=True: a graph for a second derivative
            return _differentiable_grads(ctx, grad_loss, grad_z)
        hidden, weight, bias, labels, row_weight, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        opts = ctx.opts
        z_grad_matters = grad_z is not None and opts.z_loss_scale != 0.0
        if ctx.pre is not None and not z_grad_matters:
            grads = ctx.pre
            ctx.pre = None  # scaled in place below, so a second backward must recompute
            scale = grad_loss if grad_loss is not None else torch.zeros((), device=hidden.device)
            present = [g for g in grads if g is not None]
            if ctx.backend == "triton":
                from liger_patch.ops.triton_scale import scale_

                scale_(present, scale)  # skips the pass on the device when the scale is 1
            else:
                _scale_in_fp32_(present, scale)
            return (*grads, None, None, None, None, None, None, None, None)

        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        g_loss = zero if grad_loss is None else grad_loss.float()
        g_z = zero if grad_z is None else grad_z.float()
        with torch.autocast(hidden.device.type, enabled=False):
            res = run_chunks(
                _row_kernel(ctx.backend),
                hidden,
                weight,
                bias,
                labels,
                opts,
                budget_bytes=ctx.budget,
                coef_ce=g_loss * row_weight,
                coef_z=(g_loss + g_z) * row_weight,
                lse_in=lse,
                need_hidden=need_h,
                need_weight=need_w,
                need_bias=need_b and bias is not None,
                logits_dtype=ctx.logits_dtype,
            )
        return res.grad_hidden, res.grad_weight, res.grad_bias, None, None, None, None, None, None, None, None


def _loss_options(
    ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale, **_ignored
) -> LossOptions:
    def optional(name: str, value: object) -> float | None:
        return None if value is None else validation.option_float(name, value)

    return LossOptions(
        ignore_index=ignore_index,
        label_smoothing=validation.option_float("label_smoothing", label_smoothing),
        z_loss_scale=validation.option_float("z_loss_scale", z_loss_scale),
        softcap=optional("softcap", softcap),
        logit_scale=optional("logit_scale", logit_scale),
    )


def _autocast_inputs(hidden, weight, bias):
    """Inside torch.autocast, cast like nn.Linear would; outside it, dtypes must already match."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
    validation.check_dtypes_match(hidden, weight, bias)
    return hidden, weight, bias


# torch.compile runs the op eagerly (a graph break). torch._disable_dynamo is torch.compiler.disable
# with torch._dynamo imported on the first call instead of at import: ~1 s off `import liger_patch`.
@torch._disable_dynamo
def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    num_items_in_batch: int | float | torch.Tensor | None = None,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
    return_z_loss: bool = False,
    backend: Backend = "auto",
    memory_budget: int | str | None = None,
    logits_dtype: torch.dtype | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels`` without building the logits.

    Args:
        hidden: (..., H) last hidden states, fp32/bf16/fp16.
        weight: (V, H) output projection (``lm_head.weight``).
        labels: (...) integer class ids with the leading shape of ``hidden``; ``ignore_index``
            marks tokens that do not count.
        bias: optional (V,) output bias.
        reduction: "mean" over kept tokens (or over ``num_items_in_batch``), "sum", or "none"
            (per-token losses in the leading shape, 0 at ignored tokens).
        num_items_in_batch: divisor for "mean" (int, int tensor or float tensor), as the HF Trainer
            passes it under gradient accumulation. 0 is allowed when nothing is kept.
        label_smoothing, z_loss_scale, softcap, logit_scale: see docs/loss.md.
        return_z_loss: also return the z-loss term (reduced like the loss, already inside it).
        backend: "auto" (Triton on CUDA or under TRITON_INTERPRET=1, else torch), "triton", "torch".
        memory_budget: working memory the op may use beyond its inputs, outputs and gradients:
            bytes, a size string ("256MiB"), "default" (512 MiB) or "lean" (32 MiB). ``None``
            reads ``LIGER_MEMORY_BUDGET``, else "default". Smaller is slower (docs/loss.md). It
            covers the logits chunks, ~32 bytes per token and 2 MiB of slack; a budget below
            that still runs, one row of logits at a time.
        logits_dtype: how logits chunks are stored. ``None``: the input dtype, as an unpatched
            head stores its logits (the GEMM accumulates in fp32 and rounds once on store).
            ``torch.float32``: fp32 storage, more exact than an unpatched half-precision model,
            and slower.

    Every step after the GEMMs is fp32; gradients come back in the input dtypes, only for inputs that require
    them. When no token is kept the loss is exactly 0, still attached to the graph, and every input
    that requires grad receives a zero gradient. ``torch.compile`` runs this function eagerly
    (a graph break), which keeps its results identical to eager mode. A backward with
    ``create_graph=True`` (gradient penalties, Hessian-vector products) gives gradients that can
    be differentiated again; that path builds the full logits in fp32.
    """
    opts = _loss_options(ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale)
    validation.check_options(opts, reduction, backend, num_items_in_batch)
    validation.check_tensors(hidden, weight, labels, bias)
    budget = _working_budget(resolve_memory_budget(memory_budget), labels.numel())
    hidden, weight, bias = _autocast_inputs(hidden, weight, bias)
    validation.check_logits_dtype(logits_dtype, hidden.dtype)
    lead_shape = labels.shape
    h2d = hidden.reshape(labels.numel(), hidden.shape[-1])  # not (-1, H): H may be 0
    # Contiguous: kernels index labels by row (a strided or expanded view would be misread).
    flat_labels = labels.reshape(-1).long().contiguous()
    chosen = resolve_backend(backend, hidden.device)

    keep = flat_labels != ignore_index
    divisor = _divisor(reduction, keep, num_items_in_batch)
    user_divisor = divisor if isinstance(num_items_in_batch, torch.Tensor) else None  # others checked already
    validation.check_values(flat_labels, weight.shape[0], ignore_index, user_divisor)
    row_weight = keep.float() / divisor if reduction == "mean" else keep.float()

    wants_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    with torch.autocast(hidden.device.type, enabled=False):
        if wants_grad:
            loss, z_loss = _FusedLinearCrossEntropy.apply(
                h2d,
                weight,
                bias,
                flat_labels,
                row_weight,
                divisor,
                opts,
                reduction,
                chosen,
                budget,
                logits_dtype,
            )
        else:  # forward work only: no gradient buffers, no gradient pass
            res = run_chunks(
                _row_kernel(chosen),
                h2d,
                weight,
                bias,
                flat_labels,
                opts,
                budget_bytes=budget,
                logits_dtype=logits_dtype,
                fused_logits=chosen == "triton",
            )
            loss, z_loss = _loss_and_z_loss(res.ce, res.lse, opts, reduction, divisor)
    if reduction == "none":
        loss, z_loss = loss.reshape(lead_shape), z_loss.reshape(lead_shape)
    return (loss, z_loss) if return_z_loss else loss


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`, taking the same options.

    ``forward(hidden, weight, labels, bias=None, *, num_items_in_batch=None)``; a
    ``num_items_in_batch`` given to ``forward`` overrides the one given to the constructor (it
    usually changes every step).
    """

    def __init__(
        self,
        *,
        ignore_index: int = -100,
        reduction: Reduction = "mean",
        num_items_in_batch: int | float | torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        softcap: float | None = None,
        logit_scale: float | None = None,
        return_z_loss: bool = False,
        backend: Backend = "auto",
        memory_budget: int | str | None = None,
        logits_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_items_in_batch = num_items_in_batch
        self.options = dict(
            ignore_index=ignore_index,
            reduction=reduction,
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            softcap=softcap,
            logit_scale=logit_scale,
            return_z_loss=return_z_loss,
            backend=backend,
            memory_budget=memory_budget,
            logits_dtype=logits_dtype,
        )
        validation.check_options(_loss_options(**self.options), reduction, backend, num_items_in_batch)
        if memory_budget is not None:
            parse_memory_budget(memory_budget)

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
        return fused_linear_cross_entropy(
            hidden, weight, labels, bias, num_items_in_batch=num_items_in_batch, **self.options
        )

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


def fused_loss(hidden, weight, labels, bias=None, *, options: LossOptions, num_items_in_batch=None, **overrides):
    """Temporary shim (being rewritten): the op with a built ``LossOptions``."""
    import dataclasses

    opts = options.replace(**overrides)
    kwargs = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts) if f.name != "tuning"}
    return fused_linear_cross_entropy(hidden, weight, labels, bias, num_items_in_batch=num_items_in_batch, **kwargs)
