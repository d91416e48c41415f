"""A one-process stand-in for a DeepSpeed ZeRO-3 head and TRL's gathering helper, for the tests of
``liger_patch.integrations.gathered_backward`` and of TRL's fused head on a partitioned head.

The real thing runs in tests/distributed/test_trl_zero3.py; this one runs in milliseconds and
can do what DeepSpeed on two CPU ranks does not show: poison a freed buffer, and count who
holds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


class FakeZero3:
    """Parameters partitioned as ZeRO-3 leaves them (``ds_id``/``ds_status`` set, data
    ``torch.empty(0)``), and :meth:`gather`, which stands in for TRL's ``maybe_gather_lm_head_ctx``
    (DeepSpeed's ``GatheredParameters`` over the partitioned ones among its arguments).

    Each entry gives every partitioned parameter a fresh full buffer; on exit the buffer is
    poisoned with NaN (as a buffer DeepSpeed reuses would be overwritten) and the parameter is
    freed again (``param.data = torch.empty(0)``, DeepSpeed's ``free_param``). ``entries`` lists,
    per entry, whether grad mode was on (forward) and how many parameters it gathered;
    ``buffers`` every buffer handed out.
    """

    def __init__(self, *params: torch.nn.Parameter) -> None:
        self.full: dict[int, torch.Tensor] = {}
        self.entries: list[tuple[bool, int]] = []
        self.buffers: list[torch.Tensor] = []
        for ds_id, param in enumerate(params):
            self.full[id(param)] = param.detach().clone()
            param.ds_id, param.ds_status = ds_id, "NOT_AVAILABLE"
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @contextmanager
    def gather(self, *params: torch.Tensor | None) -> Iterator[None]:
        todo = [p for p in {id(p): p for p in params if p is not None}.values() if p.ds_status != "AVAILABLE"]
        self.entries.append((torch.is_grad_enabled(), len(todo)))
        buffers = [self.full[id(p)].clone() for p in todo]
        self.buffers += buffers
        for param, buffer in zip(todo, buffers, strict=True):
            param.data, param.ds_status = buffer, "AVAILABLE"
        try:
            yield
        finally:
            for param, buffer in zip(todo, buffers, strict=True):
                buffer.fill_(float("nan"))
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
                param.ds_status = "NOT_AVAILABLE"


def storage_holders(tensor: torch.Tensor) -> int:
    """How many tensors share ``tensor``'s storage (1: ``tensor`` alone)."""

    def uses(t: torch.Tensor) -> int:
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    return uses(tensor) - uses(torch.empty(1)) + 1
