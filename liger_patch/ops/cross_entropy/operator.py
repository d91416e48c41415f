"""The fused loss as registered PyTorch operators (namespace ``liger_patch``), so that
``torch.compile`` captures a call as one graph node (``fullgraph=True``, dynamic shapes, CUDA graphs).

* ``liger_patch::flce`` computes the loss, its z-loss part, the argmax and entropy per token
  when asked, and what the backward needs (``ForwardOutputs``). With reduction "mean"/"sum" the
  upstream gradient is one scalar, so the forward also computes the gradients at scale 1 while
  the logits chunk is hot, and the backward only multiplies them by that scalar
  (``liger_patch::scale_grads_``; on Triton a kernel that reads it on the device and does nothing
  when it is 1): three GEMMs per chunk in total. This is skipped for fp16 (a GradScaler's factor
  must be applied before rounding to fp16, or small gradients underflow) and whenever the
  backward needs something else (a gradient arriving through ``z_loss`` or the entropy, or a
  second backward over a retained graph); then ``liger_patch::flce_backward`` recomputes the
  logits with exact per-row coefficients, which is also the path for reduction "none". The
  autograd formula that chooses is ``autograd.py``'s.
* Every option travels as ``LossOptions.key`` (one string), tensors as tensors.
* An optional low-rank term ``(u, B)`` adds ``u B^T`` to the logits (a LoRA adapter on the head:
  ``low_rank.py``); ``needs`` then has five entries (hidden, weight, bias, u, B) and their
  gradients are the last two outputs.
* A fake implementation gives every output's shape from the inputs' (symbolic) shapes, so a
  compiled caller is not specialised to the token count.
* ``FLCE`` is what the functional calls: the registered operator, or where the call is plain
  eager its twin, the same implementation and autograd formula as a plain
  ``torch.autograd.Function`` (``core/eager_call.py``: the registration's dispatch is host time).

Host synchronisation: none in the backward, and in the forward only to read the label range
check when skipping the ignored rows is worth the wait (``core/kept_rows.py``); else a bad label
makes the loss and every gradient NaN and raises before any optimizer step
(``core/deferred_checks.py``), and while a CUDA graph is being captured it only poisons
(docs/loss.md).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from liger_patch.ops.core import call_graph, deferred_checks, head_start
from liger_patch.ops.core.contexts import autocast_off, on_inputs_device
from liger_patch.ops.core.eager_call import EagerOp, EmptyOutputs
from liger_patch.ops.core.forward_grads import grads_in_forward
from liger_patch.ops.core.graphed_forward import GraphedForward, Later
from liger_patch.ops.core.kept_rows import (
    CheckedLabels,
    LabelCheck,
    PendingLabels,
    arrived_ahead,
    begin_label_check,
    expects_skip,
    finish_label_check,
)
from liger_patch.ops.core.reduction import reduce_rows, weighted_total
from liger_patch.ops.cross_entropy import chunk_plan, graphed_forward, one_chunk
from liger_patch.ops.cross_entropy.autograd import backward, setup_context
from liger_patch.ops.cross_entropy.backends import RowBackend, row_backend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, ChunkResult, GradsWanted, HeadInputs
from liger_patch.ops.cross_entropy.chunks import run_chunks
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs, ForwardOutputs, low_rank_needs
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.recompute import budget_bytes
from liger_patch.ops.cross_entropy.row_io import NO_OUTPUTS, ClassWeight, RowOutputs
from liger_patch.ops.cross_entropy.rows import z_loss_rows

_F32 = torch.float32


def _wants_argmax(opts: LossOptions) -> bool:
    return opts.return_token_accuracy or opts.return_predicted_tokens


def _forward_call(
    opts: LossOptions, backend: RowBackend, args: ForwardInputs, labels: Tensor, cw: ClassWeight | None
) -> ChunkCall:
    """The forward's chunk call before its label check is read: the gradients it computes (those
    ``args.needs`` asks for, when ``grads_in_forward``), the per-row outputs asked for, the class
    weights ``cw`` and the low-rank term."""
    hidden, needs = args.hidden, args.needs
    precompute = grads_in_forward(opts.reduction, hidden.dtype, needs)
    outputs = RowOutputs.empty(
        labels.shape[0], hidden.device, _wants_argmax(opts), opts.return_entropy, opts.use_token_scaling
    )
    return ChunkCall(
        backend=backend,
        inputs=HeadInputs(hidden, args.weight, args.bias),
        labels=labels,
        opts=opts,
        budget_bytes=0,  # set once the walked rows are known
        wanted=GradsWanted.of([precompute and n for n in (*needs[:3], *low_rank_needs(needs))]),
        outputs=outputs,
        class_weight=cw,
        low_rank=None if args.low_rank_u is None else (args.low_rank_u, args.low_rank_b),
    )


def _gemm_gflop(hidden: Tensor, weight: Tensor, reduction: str, needs: list[bool]) -> float:
    """The forward's GEMM work over every row, in GFLOP: the logits and the gradients computed here."""
    precompute = grads_in_forward(reduction, hidden.dtype, needs)
    gemms = 1 + sum(precompute and need for need in needs[:2])
    return 2 * hidden.shape[0] * hidden.shape[1] * weight.shape[0] * gemms / 1e9


def _begin_head(call: ChunkCall, keep: Tensor) -> tuple[head_start.HeadStart | None, int]:
    """The first chunk begun over the kept rows while the host waits for the label check to skip
    the ignored ones (``chunk_plan.start_head``), unless the budget depends on how many are kept;
    and the budget of a walk over every row."""
    budget_all = budget_bytes(call, None)
    if budget_bytes(call, call.labels[:1]) != budget_all:
        return None, budget_all
    planned = dataclasses.replace(call, budget_bytes=budget_all)
    return chunk_plan.start_head(planned, call.wanted.weight, keep), budget_all


def _checked_call(call: ChunkCall, checked: CheckedLabels, head, budget_all: int | None) -> ChunkCall:
    """The forward's call once its label check is read: the (sanitized) labels, the walked rows
    and their budget, the rows' weights as the gradients' coefficients, the head start."""
    if budget_all is None or checked.kept_rows is not None:  # budget_bytes reads shapes and options only
        budget_all = budget_bytes(call, checked.kept_rows)
    coef = checked.row_weight if call.wanted.any() else None
    return dataclasses.replace(
        call, labels=checked.labels, row_index=checked.kept_rows, head_start=head,
        budget_bytes=budget_all, coef_ce=coef, coef_z=coef,
    )  # fmt: skip


def _losses(
    opts: LossOptions, token_scale: Tensor | None, res: ChunkResult, checked: CheckedLabels, z_read: bool
) -> tuple[Tensor, Tensor | None]:
    """The loss and z-loss reduced from the rows' terms (the kernels scaled ce by the token scale
    already), NaN where the unread check poisons them. A z-loss of 0 that nothing reads
    (``z_read`` false) is ``None``: no launch."""
    poison = checked.poison
    if opts.z_loss_scale == 0.0 and opts.reduction != "none":  # the common case: fewest launches
        loss = weighted_total(res.ce, checked.row_weight)  # the weights carry the poison
        if not z_read:
            return loss, None
        return loss, torch.zeros_like(loss) if poison is None else poison * 0.0
    if opts.z_loss_scale == 0.0:
        loss = reduce_rows(res.ce, opts.reduction, checked.divisor)
        z_loss = torch.zeros_like(loss)
    else:
        z_rows = z_loss_rows(res.lse, opts, token_scale)
        loss = reduce_rows(res.ce + z_rows, opts.reduction, checked.divisor)
        z_loss = reduce_rows(z_rows, opts.reduction, checked.divisor)
    if poison is not None:
        loss, z_loss = loss * poison, z_loss * poison
    return loss, z_loss


def _forward_outputs(
    opts: LossOptions, outputs: RowOutputs, res: ChunkResult, checked: CheckedLabels, empties: EmptyOutputs
) -> ForwardOutputs:
    """The loss and z-loss, and every output (``outputs``' per-row ones; one of ``empties`` where
    none). The eager twin's z-loss is one of them too where the caller does not ask for it
    (``outputs.pack`` reads it only then); a registered operator's has the loss's shape always."""
    z_read = opts.return_z_loss or not empties.shared
    loss, z_loss = _losses(opts, outputs.token_scale, res, checked, z_read)

    def given(t: Tensor | None, dtype: torch.dtype = _F32) -> Tensor:  # outputs may not be None
        return t if t is not None else empties(dtype)

    return ForwardOutputs(
        loss,
        given(z_loss),
        given(outputs.argmax, torch.int64),
        given(outputs.entropy),
        res.lse,
        checked.row_weight,
        given(outputs.token_scale),
        given(res.grad_hidden),
        given(res.grad_weight),
        given(res.grad_bias),
        given(res.grad_u),
        given(res.grad_b),
    )


_Outputs = tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor
]  # ForwardOutputs' twelve


@on_inputs_device
def _flce(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    labels: Tensor,
    class_weight: Tensor | None,
    num_items: Tensor | None,
    num_items_value: float | None,
    options: str,
    needs: list[bool],
    low_rank_u: Tensor | None = None,
    low_rank_b: Tensor | None = None,
) -> _Outputs:
    """Forward: ``ForwardOutputs`` as a tuple; hidden (N, H), labels (N,), u (N, r), B (V, r).
    Outputs not asked for are empty (each its own tensor, as a registered operator's must be).
    ``needs`` says which of hidden, weight, bias (u, B) want gradients."""
    args = (hidden, weight, bias, labels, class_weight, num_items, num_items_value, options, needs)
    return _forward(ForwardInputs(*args, low_rank_u, low_rank_b), EmptyOutputs(hidden.device, shared=False))


@on_inputs_device
def _flce_eager(*args) -> _Outputs:
    """``_flce`` for the eager twin (``FLCE``): the outputs not asked for share one empty tensor
    per dtype (``EmptyOutputs``)."""
    return _forward(ForwardInputs(*args), EmptyOutputs(args[0].device, shared=True))


def _forward(args: ForwardInputs, empties: EmptyOutputs) -> _Outputs:
    """``_flce``'s body, its empty outputs made by ``empties``: for the eager twin (a plain eager
    call) replayed from a CUDA graph where one may serve it (``graphed_forward``)."""
    opts = LossOptions.from_key(args.options)
    hidden, weight = args.hidden, args.weight
    backend = row_backend(opts.backend, hidden.device)
    shape_key = (hidden.device, args.labels.shape[0], weight.shape[0])
    gflop = _gemm_gflop(hidden, weight, opts.reduction, args.needs)
    if empties.shared:
        key = graphed_forward.signature(args, opts, backend, shape_key, gflop)
        if key is not None:
            deferred_checks.raise_ready()  # first, as begin_label_check does
            return call_graph.run(_GRAPHED, key, weight, (args, opts, backend, shape_key, gflop))
    cw = ClassWeight.of(args.class_weight)
    pending = _begin(args, opts, backend, shape_key, gflop, cw)
    return _checked_forward(args, opts, backend, pending, empties, cw=cw)


def _begin(
    args: ForwardInputs,
    opts: LossOptions,
    backend: RowBackend,
    shape_key: tuple,
    gflop: float,
    cw: ClassWeight | None = None,
) -> PendingLabels:
    """The forward's label check, begun (``kept_rows.begin_label_check``); ``cw``: the class
    weights' record, where ``args`` has them."""
    weights = None if cw is None else cw.weight
    check = LabelCheck.of_call(args, args.weight.shape[0], opts, backend.label_check)
    return begin_label_check(check, weights, shape_key, gflop)


def _checked_forward(
    args: ForwardInputs,
    opts: LossOptions,
    backend: RowBackend,
    pending: PendingLabels,
    empties: EmptyOutputs,
    later: Later | None = None,
    cw: ClassWeight | None = None,
) -> _Outputs:
    """The forward once its label check is begun: the check finished, then one plan's launches
    where one serves the call, else the chunk loop; the outputs as a tuple. ``later``: in a CUDA
    graph's capture, where a plan's grad_W is left (made after each replay, not the graph's own
    storage). ``cw``: the class weights' record, where ``args`` has them."""
    hidden, weight = args.hidden, args.weight
    call, head, budget_all = None, None, None
    starts_head = opts.tuning.head_start_gflop > 0 and expects_skip(pending, opts.tuning)
    if starts_head and not arrived_ahead(pending):  # computed while the host waits
        call = _forward_call(opts, backend, args, pending.labels, cw)
        head, budget_all = _begin_head(call, pending.keep)
    checked = finish_label_check(pending, opts.tuning)
    key = one_chunk.signature(args, opts, backend, checked.kept_rows) if head is None else None
    plan = one_chunk.planned(key, backend)
    if plan is None:
        call = _forward_call(opts, backend, args, pending.labels, cw) if call is None else call
        call = _checked_call(call, checked, head, budget_all)
        if key is not None and later is not None:  # a capture's warm-up too takes the plan's path
            plan = one_chunk.learn_now(key, call)
        elif key is not None:
            one_chunk.learn(key, call)
    if plan is not None:  # the common small call: its launches alone
        coef = checked.row_weight if plan.wanted.any() else None
        res = plan.run(
            hidden, weight, checked.labels, coef, opts, kept=checked.kept_rows, leave_weight=later is not None
        )
        if res.grad_weight_later is not None:
            later.leave(_GRAD_WEIGHT, res.grad_weight_later)
        return tuple(_forward_outputs(opts, NO_OUTPUTS, res, checked, empties))
    with autocast_off(hidden.device.type):
        res = run_chunks(call)
    return tuple(_forward_outputs(opts, call.outputs, res, checked, empties))


_GRAPHED = GraphedForward(_begin, _checked_forward, graphed_forward.LAYOUT)
_GRAD_WEIGHT = ForwardOutputs._fields.index("grad_weight")


flce = torch.library.custom_op("liger_patch::flce", _flce, mutates_args=())


@flce.register_fake
def _flce_fake(
    hidden,
    weight,
    bias,
    labels,
    class_weight,
    num_items,
    num_items_value,
    options,
    needs,
    low_rank_u=None,
    low_rank_b=None,
):
    opts = LossOptions.from_key(options)
    n = labels.shape[0]
    loss_shape = (n,) if opts.reduction == "none" else ()

    def rows(wanted: bool, dtype: torch.dtype = _F32) -> Tensor:
        return hidden.new_empty((n,) if wanted else (0,), dtype=dtype)

    precompute = grads_in_forward(opts.reduction, hidden.dtype, needs)

    def grad_like(t: Tensor | None, need: bool) -> Tensor:
        return (
            t.new_empty(t.shape) if t is not None and precompute and need else hidden.new_empty(0, dtype=_F32)
        )

    terms = zip((low_rank_u, low_rank_b), low_rank_needs(needs), strict=True)
    return tuple(
        ForwardOutputs(
            hidden.new_empty(loss_shape, dtype=_F32),
            hidden.new_empty(loss_shape, dtype=_F32),
            rows(_wants_argmax(opts), torch.int64),
            rows(opts.return_entropy),
            rows(True),
            rows(True),
            rows(opts.use_token_scaling),
            grad_like(hidden, needs[0]),
            grad_like(weight, needs[1]),
            grad_like(bias, needs[2]),
            *(grad_like(t, need) for t, need in terms),
        )
    )


flce.register_autograd(backward, setup_context=setup_context)
FLCE = EagerOp(torch.ops.liger_patch.flce, _flce_eager, setup_context, backward)
"""``liger_patch::flce``, or its eager twin where the call is plain eager (``core/eager_call.py``);
every argument positional."""
