"""Which cross-entropy calls may be replayed from a CUDA graph of their whole eager forward, and
what such a graph depends on (``core/graphed_forward.py`` says how a forward is captured and
replayed; ``core/call_graph.py`` when).

``signature`` is the key a graph is kept under, ``None`` where no graph may serve the call;
``LAYOUT`` says what a replay copies in (the hidden states, labels and ``num_items_in_batch``
tensor) and out (the loss and z-loss, which callers keep).
"""

from __future__ import annotations

from liger_patch.ops.core.graphed_forward import BASE_ALIGN, Layout, call_key, may_graph
from liger_patch.ops.cross_entropy import one_chunk
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.forward_io import ForwardInputs, ForwardOutputs
from liger_patch.ops.cross_entropy.options import LossOptions


def signature(args: ForwardInputs, opts: LossOptions, backend: RowBackend, shape_key: tuple, gflop: float):
    """What a graph of this call depends on, or ``None`` where no graph may serve it: what any
    graphed call needs (``graphed_forward.may_graph``), and no bias, class weights, low-rank
    term or per-row outputs. The key: what a call plan's is (``one_chunk.head_key``: the
    options, environment variables, backend, the hidden states' and weight's layouts, the
    gradients wanted), then ``graphed_forward.call_key``'s (labels, ``num_items_in_batch``,
    autocast, GEMM settings)."""
    if (
        args.bias is not None
        or args.class_weight is not None
        or args.low_rank_u is not None
        or opts.return_token_accuracy
        or opts.return_predicted_tokens
        or opts.return_entropy
        or not may_graph(
            opts.tuning, (args.hidden,), args.labels, args.num_items, backend.label_check, shape_key, gflop
        )
    ):
        return None
    head = one_chunk.head_key(args, backend, BASE_ALIGN)
    return (*head, *call_key(args.labels, args.num_items, args.num_items_value))


_OUTPUTS = ForwardOutputs._fields
LAYOUT = Layout(
    copied=("hidden", "labels", "num_items"),
    vocab_weight="weight",
    kept=(_OUTPUTS.index("loss"), _OUTPUTS.index("z_loss")),
)
