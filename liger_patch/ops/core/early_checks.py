"""Label checks begun ahead of their call: where a caller that knows a forward's labels early
(a patched model, before its body runs) queues the check the loss's forward would queue, so
that its answer has come by the time the loss needs it.

A forward that waits for its check to skip the ignored rows (``kept_rows.reads_first``) waits
for everything queued before the check: begun at the loss, that is the whole model body; begun
ahead, only what came before the body, and a host-bound step's GPU is long past it. The check
itself is the same (``kept_rows.begin_label_check``), so are the decisions taken from it and
the results' bits; only when its device work is queued changes.

A check begun ahead is found by the loss's own call only for the very labels it was begun for:
the same storage, offset, shape, strides and dtype, unchanged since (the version counter that
every in-place write bumps), and the same vocabulary size, ``ignore_index``, reduction,
``num_items_in_batch`` (the same tensor, unchanged, or the same number), one-launch check and
CUDA stream (the check's results are ordered on the stream it was begun on). The table's entry
(the check begun) holds the labels and ``num_items_in_batch`` tensor alive, so no other tensor
takes their storage while it waits. Inference tensors have no version counter, so they get no
key: nothing is begun ahead for them, and a call over them queues its own check. Writes that
bypass the version counter (through ``.data``, a DLPack or NumPy alias) are not seen: a caller
that begins a check ahead must not make them. A call takes its check out of the table (once);
the caller drops one that no call took (``drop``). At most ``_MAX_AHEAD`` wait at once, the
oldest dropped first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from liger_patch.ops.core.bounded import keep_bounded

_MAX_AHEAD = 8
_AHEAD: OrderedDict[Hashable, object] = OrderedDict()


def labels_key(
    labels: Tensor,
    vocab: int,
    ignore_index: int,
    reduction: str,
    num_items: tuple[Tensor | None, float | None],
    fused_check: Callable | None,
) -> tuple | None:
    """What a check depends on, with ``labels`` (int64, contiguous) and the ``num_items_in_batch``
    tensor named by where their values live and their version counters, and the current CUDA
    stream; ``None`` for an inference tensor (no version counter)."""
    tensor, value = num_items
    if labels.is_inference() or (tensor is not None and tensor.is_inference()):
        return None
    items = (value,) if tensor is None else (id(tensor), tensor._version, tensor.device)
    stream = torch.cuda.current_stream(labels.device).stream_id if labels.is_cuda else None
    return (
        labels.untyped_storage().data_ptr(),
        labels.storage_offset(),
        tuple(labels.shape),
        labels.stride(),
        labels.dtype,
        labels.device,
        labels._version,
        vocab,
        ignore_index,
        reduction,
        items,
        fused_check,
        stream,
    )


def put(key: tuple, pending: object) -> None:
    """Keep ``pending`` (a ``kept_rows.PendingLabels``) for the call whose check has ``key``."""
    keep_bounded(_AHEAD, key, pending, _MAX_AHEAD)


def waiting() -> bool:
    """Whether any check begun ahead waits for its call (else a call need not make its key)."""
    return bool(_AHEAD)


def take(key: tuple | None) -> object | None:
    """The check begun ahead for ``key``, out of the table; ``None`` where there is none."""
    return None if key is None else _AHEAD.pop(key, None)


def drop(key: tuple) -> bool:
    """Forget the check begun for ``key`` if no call took it; whether it was still there."""
    return _AHEAD.pop(key, None) is not None
