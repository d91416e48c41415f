"""A forward that does not wait for its label check (``kept_rows``, ``deferred_checks``): it walks
every row with bad labels made ``ignore_index`` and its results poisoned, and the check's error
is raised at the next call that finds it answered, at ``raise_pending``, or before any optimizer
steps. On the CPU the answer is always on the host; here a check is made "not answered yet" by
giving it an event that has not happened (what a CUDA event is while the GPU is behind).
tests/ops/cross_entropy/test_host_syncs.py runs the real thing behind a busy GPU."""

import math

import pytest
import torch

import liger_patch as lp
from liger_patch import env
from liger_patch.ops.core import deferred_checks, kept_rows
from liger_patch.ops.core.kept_rows import NumItems
from liger_patch.ops.core.tuning import Tuning

V, IGNORE = 50, -100
NEVER_WAIT = Tuning(wait_to_skip_gflop=math.inf)


@pytest.fixture(params=["torch-ops", "one-launch"])
def fused(request):
    """How the check is begun: with PyTorch ops, or the Triton backend's one launch
    (``triton/label_check.py``): under the interpreter on these CPU tensors, or on a GPU machine
    on CUDA copies of them, its results brought back (the tests here drive the CPU's logic)."""
    if request.param == "torch-ops":
        return None
    label_check = pytest.importorskip("liger_patch.ops.core.triton.label_check").label_check
    if env.triton_interpret():
        return label_check
    assert torch.cuda.is_available(), "tests/conftest.py sets TRITON_INTERPRET where there is no GPU"

    def on_the_gpu(labels, vocab, ignore_index, reduction, num_items, num_items_value):
        items = None if num_items is None else num_items.cuda()
        done = label_check(labels.cuda(), vocab, ignore_index, reduction, items, num_items_value)
        return type(done)(*(t.cpu() for t in done))

    return on_the_gpu


class NotYet:
    """An event the GPU has not reached: ``query`` is False until ``synchronize`` waits for it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


@pytest.fixture(autouse=True)
def _no_pending():
    assert deferred_checks.pending() == 0
    yield
    assert deferred_checks.pending() == 0


def _labels(gen, n=40, share=0.25):
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < share] = IGNORE
    labels[0] = 3
    return labels


def _begin(labels, key, fused, reduction="mean", num_items=None, work_gflop=1e9):
    """A check begun on ``labels`` (of a call of ``work_gflop`` GFLOP, ``fused`` as the fixture
    says) whose answer has not come back yet, and its event."""
    num_items = num_items or NumItems()
    check = kept_rows.LabelCheck(labels, V, IGNORE, reduction, num_items, fused)
    pending = kept_rows.begin_label_check(check, None, key, work_gflop)
    event = NotYet()
    started = pending.started._replace(ready=event)
    return pending.__class__(**{**pending.__dict__, "started": started}), event


def test_unanswered_check_walks_every_row_and_is_read_later(gen, fused):
    labels = _labels(gen)
    keep = labels != IGNORE
    pending, event = _begin(labels, ("unanswered",), fused)
    assert not kept_rows.reads_first(pending, NEVER_WAIT)
    checked = kept_rows.finish_label_check(pending, NEVER_WAIT)
    assert not event.done, "the forward waited for the check"
    assert checked.kept_rows is None and checked.n_kept is None
    assert torch.equal(checked.labels, labels) and checked.poison.item() == 1.0
    torch.testing.assert_close(checked.row_weight, keep.float() / keep.sum())
    assert deferred_checks.pending() == 1
    deferred_checks.raise_ready()  # not answered: stays
    assert deferred_checks.pending() == 1
    deferred_checks.raise_pending()  # waits, finds nothing wrong
    assert event.done and deferred_checks.pending() == 0


@pytest.mark.parametrize("position", [0, 17, 39])
def test_bad_label_poisons_and_raises_before_the_optimizer_steps(gen, position, fused):
    labels = _labels(gen)
    labels[position] = V + 4
    pending, event = _begin(labels, ("bad",), fused)
    checked = kept_rows.finish_label_check(pending, NEVER_WAIT)
    assert checked.labels[position] == IGNORE, "a kernel would index with the bad label"
    assert math.isnan(checked.poison.item()) and checked.row_weight.isnan().all()
    deferred_checks.raise_ready()  # not answered yet: nothing raised
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), float("nan"))
    optimizer = torch.optim.SGD([param], lr=0.1)
    message = rf"label {V + 4} at flat position {position} is outside \[0, {V}\).*NaN"
    with pytest.raises(IndexError, match=message):
        optimizer.step()
    assert torch.equal(param.detach(), torch.ones(3)), "the optimizer stepped on the poisoned gradient"
    optimizer.step()  # raised once: the error does not come back
    assert deferred_checks.pending() == 0


def test_an_answered_check_raises_at_the_next_call(gen, fused):
    labels = _labels(gen)
    labels[5] = -7
    pending, event = _begin(labels, ("next call",), fused)
    kept_rows.finish_label_check(pending, NEVER_WAIT)
    event.done = True  # the GPU got there
    good = _labels(gen)
    with pytest.raises(IndexError, match=r"label -7 at flat position 5"):
        kept_rows.begin_label_check(kept_rows.LabelCheck(good, V, IGNORE, "mean"))


def test_answers_are_read_oldest_first_up_to_the_first_missing(gen, fused):
    """A call reads the answered checks from the oldest on and stops at the first one that has
    not come (a later one on its stream cannot have come before it): one query, not one per
    pending check. The optimizer step, or ``raise_pending``, waits for the rest."""
    first, first_event = _begin(_labels(gen), ("first",), fused)
    kept_rows.finish_label_check(first, NEVER_WAIT)
    labels = _labels(gen)
    labels[2] = V
    second, second_event = _begin(labels, ("second",), fused)
    kept_rows.finish_label_check(second, NEVER_WAIT)
    second_event.done = True
    deferred_checks.raise_ready()  # the oldest has not come: neither is read
    assert deferred_checks.pending() == 2 and not first_event.done
    first_event.done = True
    with pytest.raises(IndexError, match=rf"label {V} at flat position 2"):
        deferred_checks.raise_ready()
    assert deferred_checks.pending() == 0


def test_bad_num_items_is_deferred_too(gen, fused):
    pending, _ = _begin(_labels(gen), ("num items",), fused, num_items=NumItems(torch.tensor(-2.0)))
    checked = kept_rows.finish_label_check(pending, NEVER_WAIT)
    assert math.isnan(checked.poison.item())
    message = r"num_items_in_batch must be finite and >= 0, got -2.0 \(found after"
    with pytest.raises(ValueError, match=message):
        deferred_checks.raise_pending()


def test_labels_changed_in_place_before_the_check_is_read(gen, fused):
    labels = _labels(gen)
    labels[9] = V
    pending, _ = _begin(labels, ("changed",), fused)
    kept_rows.finish_label_check(pending, NEVER_WAIT)
    labels[9] = 1
    with pytest.raises(IndexError, match=rf"label {V} is outside"):
        deferred_checks.raise_pending()


def test_a_large_call_waits_to_skip_at_the_share_last_seen(gen, fused):
    """Unknown share: counted as all ignored. Once a check of the shape has been read, its share
    decides: 25 % ignored of 1e4 GFLOP is 2.5e3 GFLOP saved, over the default 400: it waits; a
    call of 1e3 GFLOP (250 saved) does not wait, nor skip; nor does one whose shape had no ignored
    label."""
    key = ("waits", fused is None)  # a key of its own per parametrisation: shares are learned
    labels = torch.randint(0, V, (400,), generator=gen)
    labels[torch.randperm(400, generator=gen)[:100]] = IGNORE
    pending, event = _begin(labels, key, fused, work_gflop=1e4)
    assert kept_rows.reads_first(pending, Tuning())
    checked = kept_rows.finish_label_check(pending, Tuning())
    assert event.done and checked.n_kept == 300 and checked.kept_rows.shape == (300,)
    pending, event = _begin(labels, key, fused, work_gflop=1e3)
    assert not kept_rows.reads_first(pending, Tuning())
    kept_rows.finish_label_check(pending, Tuning())
    assert not event.done
    deferred_checks.raise_pending()
    full = torch.randint(0, V, (400,), generator=gen)
    pending, event = _begin(full, key, fused, work_gflop=1e4)
    checked = kept_rows.finish_label_check(pending, Tuning())  # last read: 25 % ignored, waits
    assert event.done and checked.kept_rows is None
    pending, event = _begin(full, key, fused, work_gflop=1e9)
    assert not kept_rows.reads_first(pending, Tuning())  # the last read saw none
    kept_rows.finish_label_check(pending, Tuning())
    deferred_checks.raise_pending()


def test_an_answered_check_is_read_whatever_the_size(gen, fused):
    """The answer already on the host (always on the CPU): read, raised from at once, and the
    ignored rows skipped by their share alone."""
    labels = torch.randint(0, V, (400,), generator=gen)
    labels[:100] = IGNORE
    for work in (1.0, 1e9):
        check = kept_rows.LabelCheck(labels, V, IGNORE, "mean", NumItems(), fused)
        pending = kept_rows.begin_label_check(check, None, ("cpu",), work)
        assert kept_rows.reads_first(pending, NEVER_WAIT)
        checked = kept_rows.finish_label_check(pending, NEVER_WAIT)
        assert checked.n_kept == 300 and checked.kept_rows.shape == (300,)


def test_an_answer_come_in_time_is_read_but_changes_nothing(gen, fused):
    """On CUDA, a call that does not wait but finds its answer there reads it (an error would be
    raised at once) and walks every row as it would have without it, unsanitized: its results
    never depend on how far the GPU has got."""
    labels = _labels(gen)
    pending, event = _begin(labels, ("in time",), fused, work_gflop=1.0)
    event.done = True
    checked = kept_rows.finish_label_check(pending, Tuning())
    assert checked.n_kept is None and checked.kept_rows is None  # the divisor counted on the device
    assert checked.poison is None and checked.labels is pending.labels
    assert deferred_checks.pending() == 0
    labels[3] = V
    pending, event = _begin(labels, ("in time",), fused, work_gflop=1.0)
    event.done = True
    with pytest.raises(IndexError, match=rf"label {V} at flat position 3 is outside"):
        kept_rows.finish_label_check(pending, Tuning())


@pytest.mark.parametrize(
    ("share", "work", "tuning", "waits"),
    [
        (0.25, 1e4, Tuning(), True),
        (0.25, 1.5e3, Tuning(), False),
        (0.0, 1e9, Tuning(), False),
        (0.04, 1e9, Tuning(), False),  # under skip_ignored_share: nothing would be skipped
        (0.5, 1.0, Tuning(wait_to_skip_gflop=0), True),
        (1.0, 1e12, NEVER_WAIT, False),
    ],
)
def test_waits_to_skip(share, work, tuning, waits):
    assert tuning.waits_to_skip(share, work) is waits


@pytest.mark.parametrize("bad", [-1, float("nan"), True, "2"])
def test_wait_to_skip_gflop_is_checked(bad):
    with pytest.raises(ValueError, match="wait_to_skip_gflop"):
        Tuning(wait_to_skip_gflop=bad)


def test_the_cpu_op_raises_at_once(gen):
    """On the CPU the answer is there when the token pass starts: the call itself raises."""
    hidden, weight = torch.randn(6, 8, generator=gen), torch.randn(V, 8, generator=gen)
    labels = torch.tensor([1, 2, V, 3, IGNORE, 4])
    with pytest.raises(IndexError, match=rf"label {V} at flat position 2 is outside \[0, {V}\) and is not"):
        lp.fused_linear_cross_entropy(hidden, weight, labels)
    assert deferred_checks.pending() == 0
