"""A forward whose token pass is one chunk of every row, planned once per signature.

Most small calls (RL, DPO, small models: a few thousand tokens) run the token pass as a single
chunk over every row, with the fused logits GEMM, no bias, class weights, low-rank term or per-row
outputs. For such a call every decision ``chunks.run_chunks`` takes (the chunk plan and its budget,
the fused GEMM's applicability, grad_W's buffers, the records each row kernel gets) is the same
at every call with the same shapes, strides, alignment, dtypes, options and environment, and
taking them again costs a small call 0.1-0.5 ms of host time on an H200 (docs/perf-notes.md
item 63).

``OneChunk.of`` takes them once, from a ``ChunkCall`` of the forward the second time its
signature is seen (a token count seen once, as under dynamic padding, costs only the lookup),
with the chunk loops' own functions (``chunk_plan.plan_for``, ``chunk_plan.fused_backend``, the
fused GEMM's ``supported``); ``OneChunk.run`` issues only what ``run_chunks`` issues for that
call: the fused logits GEMM, then the chunk loop's own body (``chunks.token_chunk``: the row
kernel, grad_h and grad_W), so its results are the same bits. ``signature`` says what a plan
depends on; a call that differs in any of it (or that walks only its kept rows, or begins its
head before the label check) takes ``run_chunks``. ``Tuning.call_plans`` turns the plans off.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from liger_patch import env
from liger_patch.ops.core import call_graph
from liger_patch.ops.core.bounded import keep_bounded, touched
from liger_patch.ops.core.budget import ChunkPlan
from liger_patch.ops.core.contexts import autocast_off, without_grad
from liger_patch.ops.core.gemm import gemm_dtype_for, grad_view
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.grad_weight_layout import (
    GradWeightLater,
    WeightSpec,
    grad_weight_buffers,
    grad_weight_sum_dtype,
)
from liger_patch.ops.core.walked_rows import Chunk
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, ChunkResult, GradsWanted
from liger_patch.ops.cross_entropy.chunk_plan import fused_backend, plan_for
from liger_patch.ops.cross_entropy.chunks import ChunkLogits, token_chunk
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import RowGrad

_MAX_PLANS = 256


def signature(args: ForwardInputs, opts: LossOptions, backend: RowBackend) -> tuple | None:
    """Everything a plan depends on (``head_key``, with the base alignment that the fused GEMM's
    ``supported`` reads; ``planned`` checks the backend record is the same object), or ``None``
    where no plan can serve the call (a backend without a fused logits GEMM or with it turned
    off, a bias, class weights, a low-rank term, no rows, plans turned off)."""
    hidden, fused = args.hidden, backend.fused_logits
    tuning = opts.tuning
    if (
        fused is None
        or not (tuning.call_plans and tuning.fused_logits)
        or args.bias is not None
        or args.class_weight is not None
        or args.low_rank_u is not None
        or hidden.shape[0] == 0
    ):
        return None
    return head_key(args, backend, fused.align)


def head_key(args: ForwardInputs, backend: RowBackend, align: int) -> tuple:
    """What a call's decisions depend on beyond its labels: the options (with their tuning and
    budget), the budget's and the interpreter's environment variables as they are now, the
    backend record, the hidden states' and weight's device, dtypes, shapes, strides and base
    alignment (modulo ``align``), and which inputs want gradients (``graphed_forward`` adds the
    labels' and ``num_items_in_batch``'s)."""
    hidden, weight = args.hidden, args.weight
    return (
        args.options,
        env.memory_budget(),
        env.triton_interpret(),
        id(backend),
        hidden.device,
        hidden.dtype,
        weight.dtype,
        tuple(hidden.shape),
        hidden.stride(),
        tuple(weight.shape),
        weight.stride(),
        hidden.data_ptr() % align,
        weight.data_ptr() % align,
        tuple(args.needs),
    )


@dataclass(frozen=True)
class OneChunk:
    """The plan of a signature's calls: the backend record it was made for, the chunk plan (grad_W's
    buffers follow it), the gradients computed and the logits' dtype."""

    backend: RowBackend
    plan: ChunkPlan
    wanted: GradsWanted
    logits_dtype: torch.dtype

    @classmethod
    def of(cls, call: ChunkCall) -> OneChunk | None:
        """The plan of ``call`` (the forward's, its label check read, walking every row), or
        ``None`` where ``run_chunks`` would not run it as one chunk on the fused GEMM with no
        record, cast or copy: then every call of its signature takes ``run_chunks``."""
        hidden, weight = call.inputs.hidden, call.inputs.weight
        if (
            call.row_index is not None
            or call.head_start is not None
            or call.lse_in is not None
            or call.entropy_grad is not None
            or (call.outputs is not None and call.outputs.any())
            or not hidden.dtype == weight.dtype == gemm_dtype_for(hidden)
        ):
            return None
        fused = fused_backend(call)
        tuning = call.opts.tuning
        if fused is None or not fused.fused_logits.supported(hidden, weight, call.logits_dtype, tuning):
            return None
        plan, _ = plan_for(call, call.computes_grads and call.wanted.weight, None)
        if plan.two_pass or plan.weight_in_grad_weight or plan.rows < hidden.shape[0]:
            return None
        wanted = call.wanted if call.computes_grads else GradsWanted()
        return cls(call.backend, plan, wanted, call.logits_dtype)

    @without_grad  # gradients are computed by hand here, as in ``run_chunks``
    def run(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coef: Tensor | None,
        opts: LossOptions,
        *,
        leave_weight: bool = False,
    ) -> ChunkResult:
        """``run_chunks``' result for a call of this plan's signature, with these tensors: the
        checked ``labels`` and, where gradients are computed, ``coef`` (each row's weight in the
        reduced loss) as both coefficients. With ``leave_weight`` grad_W, where computed, is not
        made here but left to the result's ``grad_weight_later``: a CUDA graph of the forward
        leaves it out (``core/graphed_forward.Later``)."""
        backend, wanted = self.backend, self.wanted
        later = leave_weight and wanted.weight
        grad_hidden = grad_weight = grad_sum = None
        if wanted.hidden:
            grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        if wanted.weight and not later:
            grad_weight, grad_sum = grad_weight_buffers(self.plan, weight, hidden.dtype)
        with autocast_off(hidden.device.type):
            logits = torch.empty(
                hidden.shape[0], weight.shape[0], dtype=self.logits_dtype, device=hidden.device
            )
            partials = backend.fused_logits.logits_with_partials(hidden, weight, None, opts, logits)
            made = ChunkLogits(logits, partials)
            del partials  # ``token_chunk`` frees them after the row kernel
            grad = grads = None
            if wanted.any():
                grad = RowGrad(grad_view(logits, weight.dtype), coef, coef)
                sums = grad_weight if grad_sum is None else grad_sum
                grads = GradSums(grad_hidden, sums, None, self.plan.overwrite_first)
            ce, lse = token_chunk(
                backend, opts, made, labels, grad, grads, Chunk(0, hidden.shape[0]), hidden, weight
            )
            res = ChunkResult(ce, lse, grad_hidden, None, None)
            if later:  # ``GradSums.add``'s grad_W GEMM, with its operands
                sum_dtype = grad_weight_sum_dtype(self.plan, hidden.dtype)
                spec = WeightSpec(weight.shape, weight.dtype, weight.device)
                g = grad.out.to(weight.dtype)
                res.grad_weight_later = GradWeightLater(g, hidden, sum_dtype, self.plan.overwrite_first, spec)
            del made, logits, grad, grads  # before grad_W is made from its sum, as run_chunks
        res.grad_weight = grad_weight if grad_sum is None else grad_sum.to(weight.dtype)
        return res


_PLANS: OrderedDict[tuple, OneChunk | object | None] = OrderedDict()
"""signature -> its plan, ``None`` (its calls take ``run_chunks``) or ``_SEEN_ONCE``, in order of
use (``bounded``): the least recently used goes first when full."""
_SEEN_ONCE, _ABSENT = object(), object()


def planned(key: tuple | None, backend: RowBackend) -> OneChunk | None:
    """The plan made for ``key``'s calls on ``backend``, or ``None``: no key, no plan made (yet), or
    one made for another record that had the same ``id`` (a record a test built and dropped)."""
    found = None if key is None else touched(_PLANS, key)
    return found if isinstance(found, OneChunk) and found.backend is backend else None


def learn(key: tuple, call: ChunkCall) -> None:
    """What ``key``'s call ``call`` (one that ``run_chunks`` runs, its label check read) teaches:
    the first time a signature is seen, only that; the second time, its plan (``OneChunk.of``),
    so that a signature seen once costs no planning."""
    found = _PLANS.get(key, _ABSENT)
    if found is _ABSENT:
        keep_bounded(_PLANS, key, _SEEN_ONCE, _MAX_PLANS)
    elif found is _SEEN_ONCE:
        learn_now(key, call)


def learn_now(key: tuple, call: ChunkCall) -> OneChunk | None:
    """``key``'s plan made from ``call`` now, whether or not its signature was seen before: for a
    CUDA graph's capture, whose warm-up and capture must take the same path (a warm-up that ran
    ``run_chunks`` before the plan existed would leave grad_W's block reserved in the graph's
    pool, which the capture's plan then never uses)."""
    plan = OneChunk.of(call)
    keep_bounded(_PLANS, key, plan, _MAX_PLANS)
    return plan


def forget() -> None:
    """Drop every plan and graph: each signature is then planned again from its next two calls."""
    _PLANS.clear()
    call_graph.forget()
