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
depends on; a call that differs in any of it (or that begins its head before the label check)
takes ``run_chunks``. ``Tuning.call_plans`` turns the plans off.

A forward that walks only its kept rows (it read its label check first to skip the ignored
ones: a patched model's larger heads, whose check was begun before the body) has a plan of its
own, made where ``run_chunks`` would walk every row as one chunk, and so any number of kept
rows with the same decisions (``OneChunk.of``); its calls gather the kept rows and scatter their
results as ``run_chunks`` does, whatever their count. Without it that path cost a host-bound
step up to 0.7 ms of host time more than a planned call (docs/perf-notes.md item 84).
"""

from __future__ import annotations

import dataclasses
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
from liger_patch.ops.core.walked_rows import Chunk, walked
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.chunk_call import ChunkCall, ChunkResult, GradsWanted
from liger_patch.ops.cross_entropy.chunk_plan import fused_backend, plan_for
from liger_patch.ops.cross_entropy.chunks import ChunkLogits, token_chunk
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.recompute import budget_bytes
from liger_patch.ops.cross_entropy.row_io import RowGrad

_MAX_PLANS = 256


def signature(
    args: ForwardInputs, opts: LossOptions, backend: RowBackend, kept: Tensor | None = None
) -> tuple | None:
    """Everything a plan depends on (``head_key``, with the base alignment that the fused GEMM's
    ``supported`` reads, and whether the call walks only the kept rows ``kept`` lists;
    ``planned`` checks the backend record is the same object), or ``None`` where no plan can
    serve the call (a backend without a fused logits GEMM or with it turned off, a bias, class
    weights, a low-rank term, no rows or no kept row, plans turned off)."""
    hidden, fused = args.hidden, backend.fused_logits
    tuning = opts.tuning
    if (
        fused is None
        or not (tuning.call_plans and tuning.fused_logits)
        or args.bias is not None
        or args.class_weight is not None
        or args.low_rank_u is not None
        or hidden.shape[0] == 0
        or (kept is not None and kept.shape[0] == 0)
    ):
        return None
    return (head_key(args, backend, fused.align), kept is not None)


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
    buffers follow it), the gradients computed, the logits' dtype, and whether its calls walk
    only their kept rows."""

    backend: RowBackend
    plan: ChunkPlan
    wanted: GradsWanted
    logits_dtype: torch.dtype
    walks_kept: bool = False

    @classmethod
    def of(cls, call: ChunkCall) -> OneChunk | None:
        """The plan of ``call`` (the forward's, its label check read, walking every row or the
        kept rows ``call.row_index`` lists), or ``None`` where ``run_chunks`` would not run it as
        one chunk on the fused GEMM with no record, cast or copy: then every call of its
        signature takes ``run_chunks``. A plan for kept rows serves any number of them: it is
        made only where a walk of every row would be one chunk, and then so is a walk of fewer
        with the same decisions (a budget in bytes holds as many rows whatever the walk;
        ``"batch"`` sizes it to one chunk of the rows walked, ``recompute.budget_bytes``)."""
        hidden, weight = call.inputs.hidden, call.inputs.weight
        if (
            call.head_start is not None
            or call.lse_in is not None
            or call.entropy_grad is not None
            or (call.outputs is not None and call.outputs.any())
            or not hidden.dtype == weight.dtype == gemm_dtype_for(hidden)
        ):
            return None
        fused = fused_backend(call)
        tuning = call.opts.tuning
        # A walk of the kept rows reads their gathered copy: a new, contiguous tensor.
        rows = hidden if call.row_index is None else hidden.new_empty((1, hidden.shape[1]))
        if fused is None or not fused.fused_logits.supported(rows, weight, call.logits_dtype, tuning):
            return None
        grad_weight = call.computes_grads and call.wanted.weight
        # ``labels`` stand in for an index of every row, as in ``chunk_plan.start_head``.
        plan = _one_chunk_plan(call, grad_weight, None if call.row_index is None else call.labels)
        if plan is None:
            return None
        wanted = call.wanted if call.computes_grads else GradsWanted()
        return cls(call.backend, plan, wanted, call.logits_dtype, call.row_index is not None)

    @without_grad  # gradients are computed by hand here, as in ``run_chunks``
    def run(
        self,
        hidden: Tensor,
        weight: Tensor,
        labels: Tensor,
        coef: Tensor | None,
        opts: LossOptions,
        *,
        kept: Tensor | None = None,
        leave_weight: bool = False,
    ) -> ChunkResult:
        """``run_chunks``' result for a call of this plan's signature, with these tensors: the
        checked ``labels`` and, where gradients are computed, ``coef`` (each row's weight in the
        reduced loss) as both coefficients; ``kept``: the kept rows' index, for a plan that walks
        them (``walks_kept``). With ``leave_weight`` grad_W, where computed, is not made here but
        left to the result's ``grad_weight_later``: a CUDA graph of the forward leaves it out
        (``core/graphed_forward.Later``)."""
        backend, wanted = self.backend, self.wanted
        if (kept is not None) != self.walks_kept:
            raise RuntimeError("liger_patch: a call plan run with the wrong walked rows (a bug)")
        later = leave_weight and wanted.weight
        grad_hidden = grad_weight = grad_sum = None
        if wanted.hidden:  # a walk of the kept rows scatters into zeros, as ``pass_state`` makes them
            new = torch.empty if kept is None else torch.zeros
            grad_hidden = new(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        if wanted.weight and not later:
            grad_weight, grad_sum = grad_weight_buffers(self.plan, weight, hidden.dtype)
        chunk = Chunk(0, hidden.shape[0] if kept is None else kept.shape[0], kept)
        if kept is not None:
            labels, coef = walked(labels, kept), walked(coef, kept)
        with autocast_off(hidden.device.type):
            h = hidden if kept is None else chunk.take(hidden)
            logits = torch.empty(h.shape[0], weight.shape[0], dtype=self.logits_dtype, device=h.device)
            partials = backend.fused_logits.logits_with_partials(h, weight, None, opts, logits)
            made = ChunkLogits(logits, partials)
            del partials  # ``token_chunk`` frees them after the row kernel
            grad = grads = None
            if wanted.any():
                grad = RowGrad(grad_view(logits, weight.dtype), coef, coef)
                sums = grad_weight if grad_sum is None else grad_sum
                grads = GradSums(grad_hidden, sums, None, self.plan.overwrite_first)
            ce, lse = token_chunk(backend, opts, made, labels, grad, grads, chunk, h, weight)
            if kept is not None:
                ce, lse = _into_every_row(kept, hidden.shape[0], ce, lse)
            res = ChunkResult(ce, lse, grad_hidden, None, None)
            if later:  # ``GradSums.add``'s grad_W GEMM, with its operands
                sum_dtype = grad_weight_sum_dtype(self.plan, hidden.dtype)
                spec = WeightSpec(weight.shape, weight.dtype, weight.device)
                g = grad.out.to(weight.dtype)
                res.grad_weight_later = GradWeightLater(g, h, sum_dtype, self.plan.overwrite_first, spec)
            # Before grad_W is made from its sum, as in run_chunks; ``h`` may be the kept rows' copy.
            del made, logits, grad, grads, h
        res.grad_weight = grad_weight if grad_sum is None else grad_sum.to(weight.dtype)
        return res


def _into_every_row(kept: Tensor, n_rows: int, *walked_rows: Tensor) -> tuple[Tensor, ...]:
    """Each walked-rows vector scattered into zeros of every row (``chunks._set_losses``)."""
    return tuple(
        torch.zeros(n_rows, dtype=t.dtype, device=t.device).index_copy_(0, kept, t) for t in walked_rows
    )


def _one_chunk_plan(call: ChunkCall, grad_weight: bool, walk: Tensor | None) -> ChunkPlan | None:
    """``run_chunks``' plan of ``call`` walking every row (``walk`` ``None``) or as many kept rows
    as ``walk`` has, with the budget it would get for them; ``None`` where it is not one chunk of
    one pass, or puts the weight's copy in grad_W. The rows per chunk are left out: any walked
    count fits (``test_one_chunk`` compares the plans of every count)."""
    sized = dataclasses.replace(call, budget_bytes=budget_bytes(call, walk))
    plan, index = plan_for(sized, grad_weight, walk)
    walking = call.inputs.hidden.shape[0] if walk is None else walk.shape[0]
    if (
        plan.two_pass
        or plan.weight_in_grad_weight
        or plan.rows < walking
        or (walk is not None) != (index is not None)
    ):
        return None
    return dataclasses.replace(plan, rows=0)


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
