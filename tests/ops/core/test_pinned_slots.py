"""The label check's pinned slots (``ops/core/pinned_slots.py``): a slot is handed out again only
when its last view is gone and its event has completed, and the values a check reads are its own."""

from __future__ import annotations

import gc

import pytest
import torch

from liger_patch.ops.core import pinned_slots
from liger_patch.ops.core.pinned_slots import Ring

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Event:
    """An event the test completes by hand."""

    def __init__(self) -> None:
        self.done = True

    def query(self) -> bool:
        return self.done


def _ring(slots: int = 3) -> tuple[Ring, list[Event]]:
    events = [Event() for _ in range(slots)]
    return Ring(torch.zeros(slots, 4, dtype=torch.int64), events), events


def _slot(ring: Ring, view: torch.Tensor) -> int:
    return (view.data_ptr() - ring.rows.data_ptr()) // ring.rows.stride(0) // 8


def test_slots_are_handed_out_oldest_first_with_the_width_asked():
    ring, events = _ring()
    views = [ring.take(n) for n in (1, 3, 4)]
    assert [_slot(ring, v) for v, _ in views] == [0, 1, 2]
    assert [tuple(v.shape) for v, _ in views] == [(1,), (3,), (4,)]
    assert [e for _, e in views] == events


def test_a_slot_whose_view_is_alive_is_not_handed_out_again():
    ring, _ = _ring()
    views = [ring.take(4)[0] for _ in range(3)]
    assert ring.take(4) is None
    del views[1]
    gc.collect()
    again, _ = ring.take(2)
    assert _slot(ring, again) == 1


def test_a_slot_whose_copy_has_not_landed_is_not_handed_out_again():
    ring, events = _ring(slots=2)
    first, _ = ring.take(4)
    events[0].done = False  # its copy still queued
    del first
    gc.collect()
    second, _ = ring.take(4)
    assert _slot(ring, second) == 1
    del second
    gc.collect()
    held = ring.take(4)  # slot 1 again: its event has completed
    assert _slot(ring, held[0]) == 1
    assert ring.take(4) is None  # slot 0 still waits for its copy, slot 1 is held
    events[0].done = True
    assert _slot(ring, ring.take(4)[0]) == 0


@CUDA
def test_values_come_back_through_reused_and_new_slots():
    """More checks alive at once than there are slots (the last ones get new pinned tensors), then
    reuse: every check reads its own values, behind a GPU kept busy so the copies are late."""
    device = torch.device("cuda")
    sources = [torch.randint(-(2**40), 2**40, (4,), device=device) for _ in range(pinned_slots.SLOTS + 20)]
    for _round in range(2):
        torch.cuda._sleep(10_000_000)
        sent = [(pinned_slots.send_to_host(v), v) for v in sources]
        for (host, ready), v in sent:
            ready.synchronize()
            assert host.tolist() == v.tolist()
        del sent
        gc.collect()


@CUDA
def test_a_dropped_check_does_not_hand_its_slot_out_before_its_copy_lands():
    device = torch.device("cuda")
    torch.cuda._sleep(50_000_000)
    host, _ = pinned_slots.send_to_host(torch.arange(4, device=device))
    pointer = host.data_ptr()
    del host
    gc.collect()
    taken = [pinned_slots.send_to_host(torch.arange(3, device=device)) for _ in range(pinned_slots.SLOTS - 1)]
    assert all(h.data_ptr() != pointer for h, _ in taken)
    torch.cuda.synchronize()


@CUDA
def test_a_copy_on_a_side_stream_is_waited_for_on_that_stream():
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    values = torch.randint(0, 2**40, (4,), device=device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        doubled = values * 2
        host, ready = pinned_slots.send_to_host(doubled)
    ready.synchronize()
    assert host.tolist() == (values * 2).tolist()


@CUDA
@pytest.mark.parametrize("values", [torch.arange(5), torch.arange(4, dtype=torch.int32)])
def test_other_widths_and_dtypes_get_their_own_pinned_tensor(values):
    host, ready = pinned_slots.send_to_host(values.cuda())
    ready.synchronize()
    assert host.is_pinned() and host.dtype == values.dtype and host.tolist() == values.tolist()
