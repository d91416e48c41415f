"""The fused loss's whole eager forward as a CUDA graph replays it (``call_graph``).

A plain eager call of a small forward costs the host more than its GPU work: about 1-2 ms of
our Python around a handful of launches (docs/perf-notes.md items 52-66). A forward whose label
check it would not read first (``kept_rows.waits_for_check``) takes the same decisions at every
call of its signature and never waits for the GPU, so it can be captured whole, label check
included, and replayed: the host then copies the call's hidden states, labels and
``num_items_in_batch`` tensor into the graph's, launches it, copies the loss out, and reads the
label check from the launch's values, as ``kept_rows.finish_label_check`` reads a check it did
not wait for: raised now if answered, else deferred (``deferred_checks``), so a bad label still
raises before any optimizer step. The graph's forward walks every row with the sanitized labels
and the poison factor, as the plain forward does when it does not read its check first, and the
same launches on the same values give the same bits.

``signature`` says which calls may be graphed and what their graph depends on; ``GraphedForward``
is what ``call_graph`` captures, given the forward's two halves by ``operator.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from liger_patch.ops.core import kept_rows
from liger_patch.ops.core.eager_call import EmptyOutputs
from liger_patch.ops.core.kept_rows import FusedLabels, NumItems, PendingLabels
from liger_patch.ops.cross_entropy import one_chunk
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.call_graph import static_like
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs, ForwardOutputs
from liger_patch.ops.cross_entropy.options import LossOptions

Inputs = tuple[ForwardInputs, LossOptions, RowBackend, tuple, float]
"""A graphed call's inputs: the operator's arguments, their options and backend record, the
label check's shape key and the forward's GEMM work in GFLOP."""


def signature(args: ForwardInputs, opts: LossOptions, backend: RowBackend, shape_key: tuple, gflop: float):
    """What a graph of this call depends on, or ``None`` where no graph may serve it: graphs off
    (``Tuning.call_graphs``), not on CUDA or under a capture, a bias, class weights, a low-rank
    term or per-row outputs, a ``num_items_in_batch`` tensor on another device (its copy could not
    be captured), no rows, no one-launch label check, inputs that are not contiguous, hidden
    states not at a new buffer's alignment (``_BASE_ALIGN``), or a forward that would read its
    label check first now (to skip the ignored rows: that depends on the GPU's answer). The key:
    what a call plan's is (``one_chunk.head_key``: the options, environment variables, backend,
    the hidden states' and weight's layouts, the gradients wanted), the labels' dtype and count,
    the ``num_items_in_batch`` tensor's dtype and shape or number, whether autocast is on, and
    the GEMM settings a graph keeps as captured (``_gemm_settings``)."""
    hidden, labels, items = args.hidden, args.labels, args.num_items
    if (
        not (opts.tuning.call_graphs and hidden.is_cuda)
        or args.bias is not None
        or args.class_weight is not None
        or args.low_rank_u is not None
        or opts.return_token_accuracy
        or opts.return_predicted_tokens
        or opts.return_entropy
        or backend.label_check is None
        or (items is not None and items.device != hidden.device)
        or labels.shape[0] == 0
        or not (hidden.is_contiguous() and labels.is_contiguous())
        or hidden.data_ptr() % _BASE_ALIGN
        or torch.cuda.is_current_stream_capturing()
        or kept_rows.waits_for_check(shape_key, gflop, opts.tuning)
    ):
        return None
    items_key = None if items is None else (items.dtype, tuple(items.shape))
    extra = (labels.dtype, labels.shape[0], items_key, args.num_items_value)
    autocast = torch.is_autocast_enabled(hidden.device.type)
    return (*one_chunk.head_key(args, backend, _BASE_ALIGN), *extra, autocast, *_gemm_settings())


_BASE_ALIGN = 256
"""The largest pointer alignment cuBLASLt chooses kernels by (PyTorch tells it up to 256 bytes);
the graph's buffers, new ones, have at least that: a call's hidden states must too, and the
weight's alignment is part of the key."""


def _gemm_settings() -> tuple:
    """The global settings cuBLAS reads at every GEMM launch, which a graph keeps as they were at
    its capture: TF32 and the float32 matmul precision, reduced-precision reductions in half
    GEMMs, the BLAS library, deterministic algorithms."""
    matmul = torch.backends.cuda.matmul
    return (
        matmul.allow_tf32,
        getattr(matmul, "fp32_precision", None),
        torch.get_float32_matmul_precision(),
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
        torch.backends.cuda.preferred_blas_library(),
        torch.are_deterministic_algorithms_enabled(),
    )


Begin = Callable[[ForwardInputs, LossOptions, RowBackend, tuple, float], PendingLabels]
Body = Callable[[ForwardInputs, LossOptions, RowBackend, PendingLabels, EmptyOutputs], tuple]

_LOSS, _Z_LOSS = ForwardOutputs._fields.index("loss"), ForwardOutputs._fields.index("z_loss")


class GraphedForward:
    """The forward as ``call_graph`` captures and replays it (``call_graph.Graphable``), made of
    the operator's two halves: ``begin`` queues the label check, ``body`` runs the rest and
    returns the outputs as a tuple."""

    def __init__(self, begin: Begin, body: Body) -> None:
        self.begin, self.body = begin, body

    def run(self, args: ForwardInputs, opts: LossOptions, backend: RowBackend, shape_key, gflop) -> tuple:
        """The plain forward of a plain eager call."""
        pending = self.begin(args, opts, backend, shape_key, gflop)
        return self.body(args, opts, backend, pending, EmptyOutputs(args.hidden.device, shared=True))

    def static(self, args: ForwardInputs, opts, backend, shape_key, gflop) -> Inputs:
        """The call's inputs with the hidden states, labels and ``num_items_in_batch`` tensor
        copied into buffers of the graph's own (the weight is read where it is)."""
        items = args.num_items
        static = args._replace(
            hidden=static_like(args.hidden),
            labels=static_like(args.labels),
            num_items=None if items is None else static_like(items),
        )
        self.copy_in((static, opts, backend, shape_key, gflop), (args, opts, backend, shape_key, gflop))
        return static, opts, backend, shape_key, gflop

    def copy_in(self, static: Inputs, inputs: Inputs) -> None:
        """The call's values into the graph's buffers."""
        into, args = static[0], inputs[0]
        into.hidden.copy_(args.hidden)
        into.labels.copy_(args.labels)
        if args.num_items is not None:
            into.num_items.copy_(args.num_items)

    def captured(
        self, args: ForwardInputs, opts: LossOptions, backend: RowBackend, shape_key, gflop
    ) -> tuple[tuple[tuple, FusedLabels], list[Tensor]]:
        """The forward with its label check unread (``kept_rows.begin_unread_check``): its
        outputs and what the check's launch left; and the outputs a replay hands out (every one
        but the loss and z-loss, which it copies)."""
        n_items = NumItems(args.num_items, args.num_items_value)
        pending = kept_rows.begin_unread_check(
            args.labels, args.weight.shape[0], opts.ignore_index, opts.reduction, n_items,
            backend.label_check, shape_key, gflop,
        )  # fmt: skip
        outputs = self.body(args, opts, backend, pending, EmptyOutputs(args.hidden.device, shared=True))
        handed = [t for i, t in enumerate(outputs) if i not in (_LOSS, _Z_LOSS)]
        return (outputs, pending.fused), handed

    def replayed(self, inputs: Inputs, result: tuple[tuple, FusedLabels]) -> tuple:
        """The call's outputs from a replay: the loss and z-loss copied (a caller keeps them, as
        it logs them), every other one a new tensor sharing the graph's storage; and the label
        check read from the replay's launch (``kept_rows.check_replayed``)."""
        args, opts, backend, shape_key, _ = inputs
        outputs, done = result
        shared: list[Any] = [t.detach() for t in outputs]
        shared[_LOSS] = outputs[_LOSS].clone()
        if outputs[_Z_LOSS].numel():
            shared[_Z_LOSS] = outputs[_Z_LOSS].clone()
        kept_rows.check_replayed(
            args.labels.long().contiguous(), args.weight.shape[0], opts.ignore_index, opts.reduction,
            NumItems(args.num_items, args.num_items_value), backend.label_check, done, shape_key,
        )  # fmt: skip
        return tuple(shared)
