"""Pinned host memory that a kernel writes a few values into, for the host to read once an event
says the kernel has run: the label check's answer without a copy.

The label check's four int64 must reach the host without making it wait (``kept_rows``).
Copying them from the device into a new pinned tensor, with an event to wait on, cost the host
60-140 µs a call on an H200 (``check_from_stats`` inside the op; the copy's dispatch and the
pinned allocator's bookkeeping, docs/perf-notes.md items 57 and 65), where recording an event
costs 7-10. With unified addressing a CUDA kernel can store into pinned host memory directly, so
the check's kernel writes its answer into a slot of one pinned block allocated once, and the
event recorded after it says when the answer is there.

A slot is handed out again only when nothing holds its ``Lease`` (the check that reads it has
been read or dropped) and its last event has completed: no kernel ever writes into a slot whose
answer is still to be read, or that a running kernel may still write. Where the next few slots
are all taken (a host more than ``count`` calls ahead of its GPU, or that many checks unread),
``take`` gives ``None`` and the caller copies as before.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

_WIDTH = 8  # int64 a slot: 64 bytes, so every slot starts 16-byte aligned (one Triton specialization)
_TRIES = 4  # slots looked at before giving up


class Lease:
    """One slot taken: ``values`` (the slot's int64, a view of the pinned block) and ``ready``, the
    event to record after the kernel that writes them. Hold it until the values are read."""

    __slots__ = ("__weakref__", "ready", "values")

    def __init__(self, values: torch.Tensor, ready: torch.cuda.Event) -> None:
        self.values, self.ready = values, ready


class HostSlots:
    """``count`` slots of ``width`` int64 (at most 8) in one pinned block (``pin_memory``: pinned,
    which a kernel needs; tests of the bookkeeping alone may pass ``False``), handed out in turn;
    ``new_event`` makes each lease's event."""

    def __init__(
        self,
        width: int,
        count: int = 1024,
        pin_memory: bool = True,
        new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event,
    ) -> None:
        if not 0 < width <= _WIDTH or count < 1:
            raise ValueError(f"need 1 <= width <= {_WIDTH} and count >= 1, got {width} and {count}")
        block = torch.zeros(count, _WIDTH, dtype=torch.int64, pin_memory=pin_memory)
        self._views = list(block[:, :width].unbind(0))  # made once: a view a call is host time
        self._leases: list[weakref.ref | None] = [None] * count
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._new_event = new_event
        self._next = 0
        self._lock = threading.Lock()  # DataParallel runs forwards in threads

    def take(self) -> Lease | None:
        """A free slot and a new event, or ``None`` when the next slots are all still held or
        written (the caller then does without)."""
        with self._lock:
            for _ in range(_TRIES):
                i = self._next
                self._next = (i + 1) % len(self._views)
                if self._free(i):
                    lease = Lease(self._views[i], self._new_event())
                    self._leases[i], self._events[i] = weakref.ref(lease), lease.ready
                    return lease
        return None

    def _free(self, i: int) -> bool:
        held = self._leases[i]
        if held is not None and held() is not None:
            return False
        event = self._events[i]
        return event is None or event.query()


_SLOTS: dict[int, HostSlots] = {}  # by width, made at the first CUDA label check of the process


def take(width: int) -> Lease | None:
    """``HostSlots.take`` of the process's slots of ``width`` values (one pinned block serves
    every device: with unified addressing each can write it)."""
    slots = _SLOTS.get(width)
    if slots is None:
        slots = _SLOTS[width] = HostSlots(width)
    return slots.take()
