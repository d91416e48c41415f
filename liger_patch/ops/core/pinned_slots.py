"""Pinned host slots for the few values a label check sends back, reused from call to call.

A check's values (``validation.check_from_stats``: a handful of int64) travel to the host by an
asynchronous copy into pinned memory, with an event to wait on. A new pinned tensor and a new event
each call cost host time: PyTorch's pinned-memory cache hands a freed block back only once the
copies that used it have run, so a host that runs ahead of the GPU (where a small call's host time
counts) keeps allocating new ones (docs/perf-notes.md item 57). Here each device has a ring of
slots in one pinned allocation, each slot with its own event. A slot is handed out again only
when nothing can still read it: the view given out last is gone (its check was read or dropped)
and its event has completed (its copy has landed, on whatever stream it ran). When no slot is
free, a new pinned tensor and event are made as before.
"""

from __future__ import annotations

import threading
import weakref

import torch

SLOTS = 256  # more than the checks a host runs ahead by (one a call, about 40 behind 100 ms)
_WIDTH = 4  # the widest check: kept count, least and greatest label, bad divisor


class Ring:
    """Slots: the rows of ``rows`` (pinned, on CUDA), each with its event (anything with
    ``query``) and the weak reference to the view of it last handed out."""

    def __init__(self, rows: torch.Tensor, events: list):
        self.rows, self.events = rows, events
        self.handed: list[weakref.ref | None] = [None] * rows.shape[0]
        self.next = 0

    def take(self, n: int) -> tuple[torch.Tensor, object] | None:
        """A free slot's first ``n`` values and its event, or ``None``; the oldest slot first."""
        slots = self.rows.shape[0]
        for step in range(slots):
            i = (self.next + step) % slots
            ref = self.handed[i]
            if ref is not None and (ref() is not None or not self.events[i].query()):
                continue
            view = self.rows[i, :n]
            self.handed[i] = weakref.ref(view)
            self.next = (i + 1) % slots
            return view, self.events[i]
        return None


def _new_ring() -> Ring:
    rows = torch.empty(SLOTS, _WIDTH, dtype=torch.int64, pin_memory=True)
    return Ring(rows, [torch.cuda.Event() for _ in range(SLOTS)])


_RINGS: dict[int, Ring] = {}
_LOCK = threading.Lock()


def send_to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Copy the CUDA int64 vector ``values`` (at most 4) to pinned host memory without waiting,
    on the current stream: the host tensor and the event recorded after the copy. The host
    tensor's values are valid once the event has completed; the slot stays the caller's while the
    returned tensor is alive."""
    n = values.shape[0]
    taken = None
    if values.dtype == torch.int64 and n <= _WIDTH:
        with _LOCK:
            ring = _RINGS.get(values.device.index)
            if ring is None:
                ring = _RINGS[values.device.index] = _new_ring()
            taken = ring.take(n)
    if taken is None:
        host, ready = torch.empty(values.shape, dtype=values.dtype, pin_memory=True), torch.cuda.Event()
    else:
        host, ready = taken
    host.copy_(values, non_blocking=True)  # on the current stream of values' device
    ready.record(torch.cuda.current_stream(values.device))
    return host, ready
