"""Pinned slots a kernel writes the label check's answer into (``core/host_slots.py``): a slot
is handed out again only when nothing holds its lease and its event has completed; when the next
slots are all taken, ``take`` gives ``None``. On CUDA the check of a forward writes its answer
into a slot (no copy), and behind a busy GPU the answer is read right once its event says so."""

import gc

import pytest
import torch

from liger_patch.ops.core import host_slots, kept_rows, validation
from liger_patch.ops.core.host_slots import HostSlots
from liger_patch.ops.core.kept_rows import NumItems


class FakeEvent:
    """An event the test completes by hand (``done``)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def _slots(count: int, width: int = 4) -> HostSlots:
    return HostSlots(width, count, pin_memory=False, new_event=FakeEvent)


def test_slots_are_handed_out_in_turn_each_its_own_aligned_values():
    slots = _slots(3)
    leases = [slots.take() for _ in range(3)]
    ptrs = [lease.values.data_ptr() for lease in leases]
    assert len(set(ptrs)) == 3 and all(p % 16 == 0 for p in ptrs)
    assert all(lease.values.shape == (4,) and lease.values.is_contiguous() for lease in leases)
    leases[0].values.copy_(torch.tensor([1, 2, 3, 4]))
    assert leases[1].values.tolist() != [1, 2, 3, 4], "slots overlap"


def test_a_held_lease_keeps_its_slot_and_a_dropped_one_frees_it_once_its_event_completed():
    slots = _slots(2)
    first, second = slots.take(), slots.take()
    assert slots.take() is None, "both slots are held"
    first_ptr = first.values.data_ptr()
    first.ready.done = True
    assert slots.take() is None, "the event completed but the lease is still held"
    del first
    gc.collect()
    again = slots.take()
    assert again is not None and again.values.data_ptr() == first_ptr
    del second
    gc.collect()
    assert slots.take() is None, "a dropped lease whose kernel has not run yet (its event pending)"


def test_take_looks_at_a_few_slots_past_a_busy_one():
    slots = _slots(3)
    busy = slots.take()
    rest = [slots.take(), slots.take()]
    for lease in rest:
        lease.ready.done = True
    del rest
    gc.collect()
    taken = slots.take()  # the next in turn is ``busy``'s: held, so the one after it
    assert taken is not None and taken.values.data_ptr() != busy.values.data_ptr()


@pytest.mark.parametrize("width, count", [(0, 4), (9, 4), (4, 0)])
def test_bad_sizes_are_refused(width, count):
    with pytest.raises(ValueError, match="width"):
        HostSlots(width, count, pin_memory=False, new_event=FakeEvent)


def _begin(labels, vocab):
    from liger_patch.ops.core.triton.label_check import label_check

    return kept_rows.begin_label_check(labels, vocab, -100, "mean", None, NumItems(), (), 0.0, label_check)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_check_writes_its_answer_into_a_pinned_slot_read_once_its_event_completed(gen):
    labels = torch.randint(0, 1000, (5000,), generator=gen)
    labels[torch.rand(5000, generator=gen) < 0.3] = -100
    labels[7] = 999  # the greatest kept label is known
    expected = [int((labels != -100).sum()), 0, 999, 0]
    labels = labels.cuda()
    _begin(labels, 1000).started.result()  # the kernel compiled and loaded before the timing
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the check runs after this spin (about 0.1 s)
    pending = _begin(labels, 1000)
    check = pending.started
    assert check.lease is not None and check.host.is_pinned()
    assert not check.is_ready(), "the answer cannot be there before the spin ended"
    assert check.result() == expected[0]
    assert check.host.tolist()[:4] == [expected[0], *expected[1:3], 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_check_with_no_free_slot_copies_its_answer_as_before(gen):
    torch.cuda.synchronize()  # no slot waits on a kernel: only held ones are taken
    held = []
    while (lease := host_slots.take(4)) is not None:  # every slot the process has
        held.append(lease)
    labels = torch.randint(0, 50, (300,), generator=gen).cuda()
    labels[5] = 77  # out of range
    check = _begin(labels, 50).started
    assert check.lease is None and isinstance(check, validation.ValueCheck)
    with pytest.raises(IndexError, match="label 77 at flat position 5"):
        check.result()
    del held
    gc.collect()
    assert host_slots.take(4) is not None, "slots come back once their leases are dropped"
