"""The fused op's public entry points: the functional, the Module, and ``fused_loss`` (the
functional with prebuilt options, which the patched forward calls).

They check the tensors (shapes, dtypes, devices: what a fake tensor can tell), apply autocast as
``nn.Linear`` would, and call the registered operator ``liger_patch::flce`` (``operator.py``; in
a plain eager call its twin, ``operator.FLCE``), which
runs the chunks and carries the autograd formula; ``outputs.pack`` shapes the result. Nothing here
synchronises with the device or builds per-call state, so ``torch.compile(fullgraph=True)``
traces a caller straight through to the operator.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from liger_patch.ops.core import validation
from liger_patch.ops.core.contexts import on_device
from liger_patch.ops.core.eager_call import runs_plainly
from liger_patch.ops.core.kept_rows import LabelCheck, NumItems, begin_ahead
from liger_patch.ops.core.options import check_logits_dtype, constant_changes
from liger_patch.ops.cross_entropy import operator, outputs
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.low_rank import check_low_rank
from liger_patch.ops.cross_entropy.options import (
    DEFAULT_OPTIONS,
    LossOptions,
    build_options,
    options_docstring,
    options_parameters,
)


def _fused(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LossOptions,
    num_items_in_batch: int | float | torch.Tensor | None,
    class_weight: torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """The op for checked options: check the tensors, call the operator, shape the result."""
    validation.check_num_items(num_items_in_batch, opts.reduction)
    validation.check_tensors(hidden, weight, labels, bias)
    validation.check_class_weight(class_weight, weight)
    hidden, weight, bias = validation.autocast_inputs(hidden, weight, bias, cast_weight=False)
    check_logits_dtype(opts.logits_dtype, hidden.dtype)
    h2d = hidden.reshape(labels.numel(), hidden.shape[-1])  # not (-1, H): H may be 0
    flat_labels = labels.reshape(-1)
    u, b = _low_rank_inputs(low_rank, hidden, weight)
    grad_on = torch.is_grad_enabled()
    needs = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias, u, b)]
    low_rank_operands = () if u is None else (u.reshape(labels.numel(), u.shape[-1]), b)
    loss, z_loss, argmax, entropy, *_ = operator.FLCE(
        h2d,
        weight,
        bias,
        flat_labels,
        class_weight,
        *validation.num_items_operands(num_items_in_batch),
        opts.key,
        needs if u is not None else needs[:3],
        *low_rank_operands,
    )
    return outputs.pack(opts, labels, loss, z_loss, argmax, entropy)


def _low_rank_inputs(low_rank, hidden, weight) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(u, B)`` checked (``low_rank.check_low_rank``), u cast as autocast cast the hidden states
    (B, like the weight, is rounded by the op itself), or ``(None, None)``."""
    if low_rank is None:
        return None, None
    u, b = low_rank
    check_low_rank(hidden, weight, u, b)
    return u.to(hidden.dtype) if torch.is_autocast_enabled(hidden.device.type) else u, b


def fused_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    options: LossOptions = DEFAULT_OPTIONS,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    **overrides: Any,
):
    """:func:`fused_linear_cross_entropy` with its options already built: ``options`` with
    ``overrides`` applied (built once per distinct call under ``torch.compile``, as a constant).
    The patched forward calls this. ``low_rank`` ``(u, B)``, u (..., r) with the hidden states'
    leading shape and B (V, r), adds ``u B^T`` to the logits (a LoRA adapter on the head:
    ``low_rank.py``), and u and B get their gradients."""
    options = build_options(options.key, **constant_changes(overrides))
    return _fused(hidden, weight, labels, bias, options, num_items_in_batch, class_weight, low_rank)


def check_labels_ahead(
    labels: torch.Tensor,
    vocab: int,
    *,
    options: LossOptions = DEFAULT_OPTIONS,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    **overrides: Any,
) -> tuple | None:
    """Queue now the label check of a later :func:`fused_loss` call whose labels are these
    ``labels`` (int64, contiguous; the call may pass them reshaped) against a weight of ``vocab``
    rows, with these options (``overrides`` applied) and ``num_items_in_batch``: that call then
    takes it instead of queuing its own (``core/early_checks.py``), the same check and results,
    its answer long arrived where the caller begins it before its model's body. Returns the key
    to give ``early_checks.drop`` once the call is over (a call that never came leaves its
    check behind), or ``None`` where nothing was begun: ``Tuning.check_labels_ahead`` off, a
    traced or transformed call, labels not int64 and contiguous, no labels, inference tensors, a
    graph capture, a bad ``num_items_in_batch`` (the call raises for it). Writes to the labels
    that bypass their version counter (``.data``, DLPack or NumPy aliases) before the call are
    not seen: the caller must not make them (``core/early_checks.py``)."""
    opts = build_options(options.key, **constant_changes(overrides))
    if not opts.tuning.check_labels_ahead or torch.is_inference_mode_enabled():
        return None
    try:
        validation.check_num_items(num_items_in_batch, opts.reduction)
    except (TypeError, ValueError):
        return None  # the call itself raises it, where it always has
    items = validation.num_items_operands(num_items_in_batch)
    if not labels.is_contiguous() or not runs_plainly((labels, items[0])):
        return None  # (a call's reshape of other labels would copy them: never the same tensor)
    fused = row_backend(opts.backend, labels.device).label_check
    check = LabelCheck(labels.view(-1), vocab, opts.ignore_index, opts.reduction, NumItems(*items), fused)
    with on_device(labels.device):  # a model split over GPUs: its labels need not be on the current one
        return begin_ahead(check)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    class_weight: torch.Tensor | None = None,
    **options: Any,
):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, never building the logits.

    Args:
        hidden: (..., H) last hidden states, fp32/bf16/fp16.
        weight: (V, H) output projection (``lm_head.weight``).
        labels: (...) integer class ids with the leading shape of ``hidden``; ``ignore_index``
            marks tokens that do not count.
        bias: optional (V,) output bias.
        num_items_in_batch: divisor for "mean" (int, int tensor or float tensor), as the HF Trainer
            passes it under gradient accumulation. 0 is allowed when nothing is kept.
        class_weight: optional (V,) weight per class, ``F.cross_entropy``'s ``weight=``: each
            token's cross-entropy is weighted by its label's weight (label smoothing weights
            class j by w_j), and "mean" divides by the summed weights of the kept tokens.

    Options (keywords; one ``LossOptions``, docs/loss.md has the math):
        <OPTIONS>

    Returns the loss, or with any ``return_*`` option a named tuple ``(loss, <the outputs asked
    for>)`` in the order z_loss, token_accuracy, predicted_tokens, entropy (so ``loss, z_loss =
    op(..., return_z_loss=True)`` unpacks, and ``out.entropy`` reads by name).

    Every step after the GEMMs is fp32; gradients come back in the input dtypes, only for inputs
    that require them. When no token is kept the loss is exactly 0, still attached to the graph,
    and every input that requires grad receives a zero gradient. The op is the registered
    operator ``torch.ops.liger_patch.flce``: ``torch.compile`` (``fullgraph=True``, dynamic
    shapes, ``mode="reduce-overhead"``) captures it as one node. A backward with
    ``create_graph=True`` (gradient penalties, Hessian-vector products) gives gradients that can
    be differentiated again; that path builds the full logits in fp32.
    """
    opts = build_options(DEFAULT_OPTIONS.key, where="fused_linear_cross_entropy", **constant_changes(options))
    return _fused(hidden, weight, labels, bias, opts, num_items_in_batch, class_weight)


fused_linear_cross_entropy.__doc__ = fused_linear_cross_entropy.__doc__.replace(
    "        <OPTIONS>", options_docstring()
)
fused_linear_cross_entropy.__signature__ = inspect.Signature(
    [
        *list(inspect.signature(fused_linear_cross_entropy).parameters.values())[:6],
        *options_parameters(),
    ],
    return_annotation="torch.Tensor | FusedLossOutput",
)


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`, taking the same options.

    ``forward(hidden, weight, labels, bias=None, *, num_items_in_batch=None, class_weight=None)``; a
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
        class_weight: torch.Tensor | None = None,
    ):
        if num_items_in_batch is None:
            num_items_in_batch = self.num_items_in_batch
        options = build_options(self.options.key)  # a constant under torch.compile (see build_options)
        return _fused(hidden, weight, labels, bias, options, num_items_in_batch, class_weight)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.changed().items())


FusedLinearCrossEntropyLoss.__init__.__signature__ = inspect.Signature(
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter("num_items_in_batch", inspect.Parameter.KEYWORD_ONLY, default=None),
        *options_parameters(),
    ]
)
