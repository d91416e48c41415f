"""The fused distillation loss as registered PyTorch operators, so that ``torch.compile`` captures a
call as one graph node (``fullgraph=True``, dynamic shapes, CUDA graphs), following the
cross-entropy operator's pattern.

* ``liger_patch::fused_distill`` computes the loss and, with reduction "mean"/"sum" (one scalar
  upstream gradient), the student's gradients at scale 1 while the chunks are hot; the backward
  only multiplies them by that scalar (``liger_patch::scale_grads_``). Not for fp16 (a
  GradScaler's factor must come before the rounding to fp16) nor for reduction "none": then
  ``liger_patch::fused_distill_backward`` recomputes the logits with per-token coefficients.
* Options travel as ``DistillOptions.key``; ``needs`` says which of the student's hidden,
  weight and bias want gradients. The teacher's tensors never get one.
* When the forward computed the gradients, the node keeps nothing else (the teacher's hidden
  states are released after the forward); a second backward over a retained graph is then
  refused. The recompute path keeps the teacher's tensors, inference tensors included (held
  as attributes: autograd cannot save those, and they get no gradient). Under ``torch.compile``
  AOTAutograd saves them itself and refuses inference tensors there: a compiled call that
  recomputes (reduction "none", an fp16 student) needs a teacher run under ``torch.no_grad``.

* ``FUSED_DISTILL`` is what the functional calls: the registered operator, or where the call is
  plain eager its twin (``core/eager_call.py``), the same implementation and formula.

The label check is the cross-entropy op's (``core/kept_rows.py``): the forward waits for it only
where skipping the ignored rows pays for the wait (then, with at least
``Tuning.skip_ignored_share`` of them ignored, the chunks gather the kept rows, and while the host
waits the GPU computes the start of the teacher's first logits chunk: ``triton_chunk.start_head``,
as ``head_start`` does for the cross-entropy op); otherwise every row is walked (an ignored one
gives 0), a bad label makes the results NaN and the check is deferred (``core/deferred_checks``),
and while a CUDA graph is captured it is not kept at all.
"""

from __future__ import annotations

import torch
from torch import Tensor

from liger_patch.ops.core import budget, call_graph, deferred_checks, kept_rows
from liger_patch.ops.core.backends import Backend, pick
from liger_patch.ops.core.contexts import autocast_off, on_inputs_device
from liger_patch.ops.core.eager_call import EagerOp
from liger_patch.ops.core.forward_grads import ForwardGrads, grads_in_forward, spent_error
from liger_patch.ops.core.gemm import gemm_dtype_for
from liger_patch.ops.core.graphed_forward import GraphedForward, Later
from liger_patch.ops.core.head_start import HeadStart
from liger_patch.ops.core.kept_rows import (
    LabelCheck,
    PendingLabels,
    begin_label_check,
    expects_skip,
    finish_label_check,
)
from liger_patch.ops.core.reduction import reduce_rows
from liger_patch.ops.distillation import graphed_forward
from liger_patch.ops.distillation.chunks import (
    TORCH_MATH,
    TORCH_MATH_WITH_IGNORED,
    ChunkMath,
    DistillCall,
    Head,
    Side,
    run_distill,
)
from liger_patch.ops.distillation.forward_io import DistillInputs
from liger_patch.ops.distillation.options import DistillOptions, check_logits_dtypes

_F32 = torch.float32


def _empty(like: Tensor) -> Tensor:
    return torch.empty(0, dtype=_F32, device=like.device)


def _budget(opts: DistillOptions, student_hidden: Tensor, n_rows: int) -> int:
    return budget.working_bytes(opts.memory_budget, n_rows, student_hidden.nbytes)


def _start_head(
    backend: Backend,
    student: Head,
    teacher: Head,
    opts: DistillOptions,
    keep: Tensor,
    want_grad: bool,
    budget_bytes: int,
) -> HeadStart | None:
    """The teacher's first logits chunk over the kept rows, begun while the host waits for the
    label check to skip the ignored ones (Triton backend, GEMMs in the inputs' dtypes)."""
    if backend.name == "torch" or any(gemm_dtype_for(h.hidden) != h.hidden.dtype for h in (student, teacher)):
        return None
    from liger_patch.ops.distillation.triton_chunk import start_head

    with autocast_off(student.hidden.device.type):
        return start_head(
            backend, Side.of(student), Side.of(teacher), opts,
            want_grad=want_grad, budget_bytes=budget_bytes, keep=keep,
        )  # fmt: skip


def _gemm_gflop(student: Head, teacher: Head, needs: list[bool], precompute: bool) -> float:
    """The forward's GEMM work over every row, in GFLOP: both heads' logits, and the student's
    gradients when computed here."""
    n_rows = student.hidden.shape[0]
    gemms = [teacher, student] + [student] * sum(precompute and need for need in needs[:2])
    return sum(2 * n_rows * h.weight.shape[0] * h.weight.shape[1] for h in gemms) / 1e9


def chunk_math(backend: Backend, head: HeadStart | None = None, *, with_ignored: bool = False) -> ChunkMath:
    """The chunk work of ``backend`` (``backends.pick``'s); the Triton one imports Triton and
    takes the teacher's ``head`` (``triton_chunk.start_head``) for its first chunk.
    ``with_ignored``: the walk may include ignored rows (the Triton kernel always zeroes them)."""
    if backend.name == "torch":
        return TORCH_MATH_WITH_IGNORED if with_ignored else TORCH_MATH
    from liger_patch.ops.distillation.triton_chunk import triton_math

    return triton_math(backend, head)


_Outputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


@on_inputs_device
def _fused_distill(
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    labels: Tensor,
    num_items: Tensor | None,
    num_items_value: float | None,
    options: str,
    needs: list[bool],
) -> _Outputs:
    """Forward: ``(loss, row_weight, grad_hidden, grad_weight, grad_bias)``; hidden states (N, H_s)
    and (N, H_t), labels (N,). Gradients not computed here are empty."""
    inputs = DistillInputs(
        student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias,
        labels, num_items, num_items_value, options, needs,
    )  # fmt: skip
    opts, backend, shape_key, gflop = _call_facts(inputs)
    return _checked_forward(inputs, opts, backend, _begin(inputs, opts, backend, shape_key, gflop))


@on_inputs_device
def _fused_distill_eager(*args) -> _Outputs:
    """``_fused_distill`` for the eager twin (``FUSED_DISTILL``): replayed from a CUDA graph where
    one may serve the call (``graphed_forward``)."""
    inputs = DistillInputs(*args)
    opts, backend, shape_key, gflop = _call_facts(inputs)
    key = graphed_forward.signature(inputs, opts, backend, shape_key, gflop)
    if key is not None:
        deferred_checks.raise_ready()  # first, as begin_label_check does
        return call_graph.run(_GRAPHED, key, inputs.student_weight, (inputs, opts, backend, shape_key, gflop))
    return _checked_forward(inputs, opts, backend, _begin(inputs, opts, backend, shape_key, gflop))


def _call_facts(args: DistillInputs) -> tuple[DistillOptions, Backend, tuple, float]:
    """The call's options (dtypes checked), backend record, label check's shape key and the
    forward's GEMM work in GFLOP."""
    opts = DistillOptions.from_key(args.options)
    sh = args.student_hidden
    check_logits_dtypes(opts, sh.dtype, args.teacher_hidden.dtype)
    vocab = args.student_weight.shape[0]
    precompute = grads_in_forward(opts.reduction, sh.dtype, args.needs)
    student, teacher = _heads(args)
    gflop = _gemm_gflop(student, teacher, args.needs, precompute)
    return opts, pick(opts.backend, sh.device), ("distill", sh.device, args.labels.shape[0], vocab), gflop


def _heads(args: DistillInputs) -> tuple[Head, Head]:
    return (
        Head(args.student_hidden, args.student_weight, args.student_bias),
        Head(args.teacher_hidden, args.teacher_weight, args.teacher_bias),
    )


def _begin(args: DistillInputs, opts: DistillOptions, backend: Backend, shape_key: tuple, gflop: float):
    """The forward's label check, begun (``kept_rows.begin_label_check``)."""
    check = LabelCheck.of_call(args, args.student_weight.shape[0], opts, backend.label_check)
    return begin_label_check(check, None, shape_key, gflop)


def _checked_forward(
    args: DistillInputs,
    opts: DistillOptions,
    backend: Backend,
    pending: PendingLabels,
    _empties=None,
    later: Later | None = None,
) -> _Outputs:
    """The forward once its label check is begun: the check finished, then the chunk loop.
    ``later``: in a CUDA graph's capture, where a forward of one chunk leaves the student's
    grad_W (made after each replay, not the graph's own storage). ``_empties``: unused, as
    ``GraphedForward``'s ``Body`` has it."""
    sh = args.student_hidden
    student, teacher = _heads(args)
    precompute = grads_in_forward(opts.reduction, sh.dtype, args.needs)
    n_rows = pending.labels.shape[0]
    budget_bytes = _budget(opts, sh, n_rows)
    head = None
    if expects_skip(pending, opts.tuning):  # computed while the host waits for the check
        head = _start_head(backend, student, teacher, opts, pending.keep, precompute, budget_bytes)
    checked = finish_label_check(pending, opts.tuning)
    with_ignored = checked.kept_rows is None and checked.n_kept != n_rows
    with autocast_off(sh.device.type):
        call = DistillCall(
            student,
            teacher,
            checked.labels,
            opts,
            kept=checked.kept_rows,
            coef=checked.row_weight if precompute else None,
            needs=tuple(args.needs),
            budget_bytes=budget_bytes,
            math=chunk_math(backend, head, with_ignored=with_ignored),
            leave_weight=later is not None,
        )
        res = run_distill(call)
    if res.grad_weight_later is not None:
        later.leave(_GRAD_WEIGHT, res.grad_weight_later)
    loss = reduce_rows(res.loss, opts.reduction, checked.divisor)
    if checked.poison is not None:
        loss = loss * checked.poison
    grads = (res.grad_hidden, res.grad_weight, res.grad_bias)
    return (loss, checked.row_weight, *(g if g is not None else _empty(sh) for g in grads))


_GRAPHED = GraphedForward(_begin, _checked_forward, graphed_forward.LAYOUT)
_GRAD_WEIGHT = 3  # the outputs: loss, row weights, grad_h, grad_W, grad_b


fused_distill = torch.library.custom_op("liger_patch::fused_distill", _fused_distill, mutates_args=())


@fused_distill.register_fake
def _fused_distill_fake(
    student_hidden,
    student_weight,
    student_bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    labels,
    num_items,
    num_items_value,
    options,
    needs,
):
    opts = DistillOptions.from_key(options)
    check_logits_dtypes(opts, student_hidden.dtype, teacher_hidden.dtype)
    n = labels.shape[0]
    precompute = grads_in_forward(opts.reduction, student_hidden.dtype, needs)
    grads = (
        t.new_empty(t.shape)
        if t is not None and precompute and need
        else student_hidden.new_empty(0, dtype=_F32)
        for t, need in zip((student_hidden, student_weight, student_bias), needs, strict=True)
    )
    loss_shape = (n,) if opts.reduction == "none" else ()
    return (student_hidden.new_empty(loss_shape, dtype=_F32), student_hidden.new_empty(n, dtype=_F32), *grads)


@on_inputs_device
def _fused_distill_backward(
    student_hidden: Tensor,
    student_weight: Tensor,
    student_bias: Tensor | None,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    teacher_bias: Tensor | None,
    labels: Tensor,
    coef: Tensor,
    options: str,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    """The student's gradients (empty where not needed) of ``sum_i coef_i loss_i``, from
    recomputed logits; ``coef`` (N,) fp32 is 0 at ignored tokens."""
    opts = DistillOptions.from_key(options)
    labels = kept_rows.in_range_unless_read(
        labels.long().contiguous(), student_weight.shape[0], opts.ignore_index
    )
    kept = kept_rows.kept_index(labels, opts.ignore_index)  # a sync on the CPU only
    with_ignored = kept is None and kept_rows.walks_every_row(labels)
    with autocast_off(student_hidden.device.type):
        call = DistillCall(
            Head(student_hidden, student_weight, student_bias),
            Head(teacher_hidden, teacher_weight, teacher_bias),
            labels,
            opts,
            kept=kept,
            coef=coef.float(),
            needs=tuple(needs),
            budget_bytes=_budget(opts, student_hidden, labels.shape[0]),
            math=chunk_math(pick(opts.backend, student_hidden.device), with_ignored=with_ignored),
        )
        res = run_distill(call)
    grads = (res.grad_hidden, res.grad_weight, res.grad_bias)
    return tuple(g if g is not None else _empty(student_hidden) for g in grads)


fused_distill_backward = torch.library.custom_op(
    "liger_patch::fused_distill_backward", _fused_distill_backward, mutates_args=()
)


@fused_distill_backward.register_fake
def _fused_distill_backward_fake(
    student_hidden,
    student_weight,
    student_bias,
    teacher_hidden,
    teacher_weight,
    teacher_bias,
    labels,
    coef,
    options,
    needs,
):
    return tuple(
        t.new_empty(t.shape) if t is not None and need else student_hidden.new_empty(0, dtype=_F32)
        for t, need in zip((student_hidden, student_weight, student_bias), needs, strict=True)
    )


def _setup_context(ctx, inputs, output) -> None:
    sh, sw, sb, th, tw, tb, labels, _, _, options, needs = inputs
    _, row_weight, grad_h, grad_w, grad_b = output
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(row_weight, grad_h, grad_w, grad_b)
    ctx.options, ctx.needs = options, needs
    opts = DistillOptions.from_key(options)
    if grads_in_forward(opts.reduction, sh.dtype, needs):  # nothing else is kept
        ctx.forward_grads = ForwardGrads.held((grad_h, grad_w, grad_b), needs, opts.backend)
        ctx.save_for_backward()
        return
    ctx.forward_grads = None
    ctx.save_for_backward(sh, sw, sb, labels, row_weight, *hold_teacher(ctx, (th, tw, tb)))


def hold_teacher(ctx, teacher: tuple[Tensor, Tensor, Tensor | None]) -> tuple[Tensor | None, ...]:
    """The teacher's tensors for ``save_for_backward`` (they get no gradient; a recomputing
    backward reads them again): inference tensors cannot be saved, so those are kept as an
    attribute of ``ctx`` instead and ``None`` saved in their place (``held_teacher``)."""
    inference = [t is not None and t.is_inference() for t in teacher]
    ctx.teacher_inference = tuple(t if inf else None for t, inf in zip(teacher, inference, strict=True))
    return tuple(None if inf else t for t, inf in zip(teacher, inference, strict=True))


def held_teacher(ctx, saved: list[Tensor | None]) -> tuple[Tensor | None, ...]:
    """The teacher's tensors ``hold_teacher`` kept: the saved ones and the inference ones."""
    return tuple(t if t is not None else inf for t, inf in zip(saved, ctx.teacher_inference, strict=True))


def _backward(ctx, grad_loss, *_no_grads):
    if torch.is_grad_enabled():
        raise NotImplementedError(
            "fused_linear_distillation has no second derivative (backward with create_graph=True)"
        )
    held = ctx.forward_grads
    if held is not None and not held.spent:
        return (*held.scaled(grad_loss), *_NO_INPUT_GRADS)
    if not any(ctx.needs):  # only a teacher tensor asked for a gradient: it gets none
        return (None,) * (3 + len(_NO_INPUT_GRADS))
    if held is not None:
        raise spent_error("fused_linear_distillation")
    sh, sw, sb, labels, row_weight, *teacher = ctx.saved_tensors
    th, tw, tb = held_teacher(ctx, teacher)
    coef = torch.zeros_like(row_weight) if grad_loss is None else grad_loss.float() * row_weight
    grads = FUSED_DISTILL_BACKWARD(sh, sw, sb, th, tw, tb, labels, coef, ctx.options, ctx.needs)
    return (*(g if need else None for g, need in zip(grads, ctx.needs, strict=True)), *_NO_INPUT_GRADS)


# The teacher's hidden, weight and bias, labels, num_items, num_items_value, options, needs.
_NO_INPUT_GRADS = (None,) * 8


fused_distill.register_autograd(_backward, setup_context=_setup_context)
FUSED_DISTILL = EagerOp(torch.ops.liger_patch.fused_distill, _fused_distill_eager, _setup_context, _backward)
"""``liger_patch::fused_distill``, or its eager twin where the call is plain eager
(``core/eager_call.py``); every argument positional."""
FUSED_DISTILL_BACKWARD = EagerOp(torch.ops.liger_patch.fused_distill_backward, _fused_distill_backward)
"""``liger_patch::fused_distill_backward``, or its implementation where the call is plain eager."""
