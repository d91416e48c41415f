"""A fused loss's whole eager forward as ``call_graph`` captures and replays it: what both ops'
graphs share (``cross_entropy/graphed_forward.py``, ``distillation/graphed_forward.py`` say
which of their calls qualify and what their graphs depend on).

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

A body may leave an output out of the graph (``Later``): the weight's gradient of a forward of
one token chunk, made after each replay by the same GEMM from the graph's buffers. An output
of the graph's own is the graph's storage, which a replay rewrites: a weight's gradient kept
in ``.grad`` (gradient accumulation) or summed with a tied embedding's would hold back every
replay after it, or cost one such gradient more at every step. Made anew, it is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from liger_patch.ops.core import kept_rows
from liger_patch.ops.core.eager_call import EmptyOutputs
from liger_patch.ops.core.kept_rows import FusedCheck, FusedLabels, LabelCheck, PendingLabels
from liger_patch.ops.core.tuning import Tuning

BASE_ALIGN = 256
"""The largest pointer alignment cuBLASLt chooses kernels by (PyTorch tells it up to 256 bytes);
the graph's buffers, new ones, have at least that: a call's hidden states must too, and the
weights' alignment is part of the key."""


def gemm_settings() -> tuple:
    """The global settings cuBLAS reads at every GEMM launch, which a graph keeps as they were at
    its capture: TF32 and the float32 matmul precision, reduced-precision reductions and fp16
    accumulation in half GEMMs, the BLAS library, deterministic algorithms."""
    matmul = torch.backends.cuda.matmul
    return (
        matmul.allow_tf32,
        getattr(matmul, "fp32_precision", None),
        torch.get_float32_matmul_precision(),
        matmul.allow_fp16_reduced_precision_reduction,
        matmul.allow_bf16_reduced_precision_reduction,
        getattr(matmul, "allow_fp16_accumulation", None),
        torch.backends.cuda.preferred_blas_library(),
        torch.are_deterministic_algorithms_enabled(),
    )


def static_like(t: Tensor) -> Tensor:
    """A graph's input buffer of ``t``'s shape, strides and dtype on its device."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def may_graph(
    tuning: Tuning,
    hiddens: Sequence[Tensor],
    labels: Tensor,
    num_items: Tensor | None,
    fused_check: FusedCheck | None,
    shape_key: tuple,
    work_gflop: float,
) -> bool:
    """What every graphed call needs: graphs on (``Tuning.call_graphs``), CUDA, no capture of the
    caller's own under way, the backend's one-launch label check, some labels, a
    ``num_items_in_batch`` tensor (if any) on the hidden states' device (its copy could not be
    captured otherwise), contiguous labels and hidden states, hidden states at a new buffer's
    alignment (``BASE_ALIGN``), and a forward that would not read its label check first (to skip
    the ignored rows: that depends on the GPU's answer)."""
    first = hiddens[0]
    return (
        tuning.call_graphs
        and first.is_cuda
        and fused_check is not None
        and (num_items is None or num_items.device == first.device)
        and labels.shape[0] > 0
        and labels.is_contiguous()
        and all(h.is_contiguous() and h.data_ptr() % BASE_ALIGN == 0 for h in hiddens)
        and not torch.cuda.is_current_stream_capturing()
        and not kept_rows.waits_for_check(shape_key, work_gflop, tuning)
    )


def call_key(labels: Tensor, num_items: Tensor | None, num_items_value: float | None) -> tuple:
    """What every graph depends on beyond its op's own inputs: the labels' dtype and count, the
    ``num_items_in_batch`` tensor's dtype and shape or its number, whether autocast and inference
    mode are on, and the GEMM settings a graph keeps as captured (``gemm_settings``)."""
    items_key = None if num_items is None else (num_items.dtype, tuple(num_items.shape))
    autocast = torch.is_autocast_enabled(labels.device.type)
    inference = torch.is_inference_mode_enabled()  # a graph's buffers made under it are inference tensors
    return (labels.dtype, labels.shape[0], items_key, num_items_value, autocast, inference, *gemm_settings())


class Layout(NamedTuple):
    """Where a forward's arguments and outputs are, by name and position: the tensor arguments a
    replay copies into the graph's buffers (the weights are read where they are), the weight
    whose rows are the vocabulary, and the outputs a replay copies out (a caller keeps them,
    as it logs the loss); every other output is handed out sharing the graph's storage."""

    copied: tuple[str, ...]
    vocab_weight: str
    kept: tuple[int, ...]


Inputs = tuple[Any, Any, Any, tuple, float]
"""A graphed call's inputs: the operator's arguments (a ``NamedTuple`` with ``labels``,
``num_items`` and ``num_items_value``), their options (with ``ignore_index`` and ``reduction``),
the backend record (with ``label_check``), the label check's shape key and the forward's GEMM
work in GFLOP."""


class Later:
    """The outputs a captured forward's body leaves out of its graph (by index in its outputs),
    each made by a function of the graph's buffers alone (no weight: a graph keeps none alive),
    called eagerly after each replay on the replay's stream."""

    def __init__(self) -> None:
        self.outputs: dict[int, Callable[[], Tensor]] = {}

    def leave(self, index: int, make: Callable[[], Tensor]) -> None:
        """Output ``index`` made by ``make()`` after each replay."""
        self.outputs[index] = make


Begin = Callable[[Any, Any, Any, tuple, float], PendingLabels]
Body = Callable[[Any, Any, Any, PendingLabels, EmptyOutputs, "Later | None"], tuple]
"""The forward once its label check is begun; with a ``Later`` (in a capture) it may leave
outputs to it, else it makes every one."""


class GraphedForward:
    """An op's forward as ``call_graph`` captures and replays it (``call_graph.Graphable``), made
    of the operator's two halves: ``begin`` queues the label check, ``body`` runs the rest and
    returns the outputs as a tuple (in a capture, leaving some to a ``Later``); ``layout`` names
    what a replay copies."""

    def __init__(self, begin: Begin, body: Body, layout: Layout) -> None:
        self.begin, self.body, self.layout = begin, body, layout

    def run(self, args, opts, backend, shape_key: tuple, gflop: float) -> tuple:
        """The plain forward of a plain eager call."""
        pending = self.begin(args, opts, backend, shape_key, gflop)
        return self.body(args, opts, backend, pending, _empties(args), None)

    def static(self, args, opts, backend, shape_key: tuple, gflop: float) -> Inputs:
        """The call's inputs with the copied tensors copied into buffers of the graph's own."""
        buffers = {name: static_like(t) for name, t in self._copied(args)}
        inputs = (args._replace(**buffers), opts, backend, shape_key, gflop)
        self.copy_in(inputs, (args, opts, backend, shape_key, gflop))
        return inputs

    def copy_in(self, static: Inputs, inputs: Inputs) -> None:
        """The call's values into the graph's buffers."""
        into = static[0]
        for name, t in self._copied(inputs[0]):
            getattr(into, name).copy_(t)

    def captured(self, args, opts, backend, shape_key: tuple, gflop: float) -> tuple[tuple, list[Tensor]]:
        """The forward with its label check unread (``kept_rows.begin_unread_check``): its
        outputs, what the check's launch left and the outputs left to after a replay
        (``Later``); and the outputs a replay hands out."""
        pending = kept_rows.begin_unread_check(self._check(args, opts, backend), shape_key, gflop)
        later = Later()
        outputs = self.body(args, opts, backend, pending, _empties(args), later)
        handed = [t for i, t in enumerate(outputs) if i not in self.layout.kept and i not in later.outputs]
        return (outputs, pending.fused, later), handed

    def replayed(self, inputs: Inputs, result: tuple[tuple, FusedLabels, Later]) -> tuple:
        """The call's outputs from a replay: the kept ones copied, those left out of the graph
        made now (``Later``), every other one a new tensor sharing the graph's storage; and the
        label check read from the replay's launch (``kept_rows.check_replayed``)."""
        args, opts, backend, shape_key, _ = inputs
        outputs, done, later = result
        shared: list[Any] = [t.detach() for t in outputs]
        for i in self.layout.kept:
            if outputs[i].numel():
                shared[i] = outputs[i].clone()
        kept_rows.check_replayed(self._check(args, opts, backend), done, shape_key)
        for i, make in later.outputs.items():
            shared[i] = make()
        return tuple(shared)

    def buffers(self, static: Inputs) -> Inputs:
        """The graph's buffers of ``static``: every other tensor argument (the weights, read where
        they are) let go."""
        args, copied = static[0], self.layout.copied
        read = [f for f in args._fields if isinstance(getattr(args, f), Tensor) and f not in copied]
        return (args._replace(**dict.fromkeys(read)), *static[1:])

    def _copied(self, args) -> list[tuple[str, Tensor]]:
        return [(name, t) for name in self.layout.copied if (t := getattr(args, name)) is not None]

    def _check(self, args, opts, backend) -> LabelCheck:
        """The call's label check, with the backend's one launch."""
        vocab = getattr(args, self.layout.vocab_weight).shape[0]
        return LabelCheck.of_call(args, vocab, opts, backend.label_check)


def _empties(args) -> EmptyOutputs:
    return EmptyOutputs(args.labels.device, shared=True)
