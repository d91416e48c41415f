"""Which distillation calls may be replayed from a CUDA graph of their whole eager forward, and
what such a graph depends on (``core/graphed_forward.py`` says how a forward is captured and
replayed; ``core/call_graph.py`` when).

``signature`` is the key a graph is kept under, ``None`` where no graph may serve the call;
``LAYOUT`` says what a replay copies in (both sides' hidden states, the labels and the
``num_items_in_batch`` tensor) and out (the loss). The graph reads the student's weight where
it was at the capture (``call_graph`` refuses a replay while it is elsewhere) and the teacher's
too, whose address is therefore part of the key: a teacher weight found elsewhere (gathered or
cast anew, ZeRO-3 or autocast) is another signature, replayed only where a later call finds its
weights at those addresses again (the graph keeps neither alive: ``GraphedForward.buffers``).
"""

from __future__ import annotations

from liger_patch import env
from liger_patch.ops.core.backends import Backend
from liger_patch.ops.core.graphed_forward import BASE_ALIGN, Layout, call_key, may_graph
from liger_patch.ops.distillation.forward_io import DistillInputs
from liger_patch.ops.distillation.options import DistillOptions


def signature(args: DistillInputs, opts: DistillOptions, backend: Backend, shape_key: tuple, gflop: float):
    """What a graph of this call depends on, or ``None`` where no graph may serve it: what any
    graphed call needs (``graphed_forward.may_graph``, for both sides' hidden states), and no
    bias on either side. The key: the options (with their tuning and budget), the budget's and
    the interpreter's environment variables, the backend record, both sides' hidden states' and
    weights' dtypes, shapes and strides, the student weight's alignment and the teacher
    weight's address, the gradients wanted, then ``graphed_forward.call_key``'s (labels,
    ``num_items_in_batch``, autocast, GEMM settings)."""
    sh, sw, th, tw = args.student_hidden, args.student_weight, args.teacher_hidden, args.teacher_weight
    items = args.num_items
    if (
        args.student_bias is not None
        or args.teacher_bias is not None
        or not may_graph(opts.tuning, (sh, th), args.labels, items, backend.label_check, shape_key, gflop)
    ):
        return None
    layouts = tuple((t.dtype, tuple(t.shape), t.stride()) for t in (sh, sw, th, tw))
    return (
        args.options,
        env.memory_budget(),
        env.triton_interpret(),
        id(backend),
        sh.device,
        *layouts,
        sw.data_ptr() % BASE_ALIGN,
        tw.data_ptr(),
        tuple(args.needs),
        *call_key(args.labels, args.num_items, args.num_items_value),
    )


LAYOUT = Layout(
    copied=("student_hidden", "teacher_hidden", "labels", "num_items"),
    vocab_weight="student_weight",
    kept=(0,),  # the loss; then the row weights and the student's gradients
)
