"""A label check begun ahead (``functional.check_labels_ahead``, ``core/early_checks.py``): the
loss's call over the very labels takes it and gives the results it gives without it, bit for bit;
a call over other labels, or over the same labels changed since, or with other check arguments,
queues its own and is right for what it was given."""

from __future__ import annotations

import pytest
import torch
from op_helpers import (
    assert_close,
    assert_same_bits,
    call_op,
    checks_taken_ahead,
    make_case,
    record_calls,
    reference_for,
)

import liger_patch as lp
from liger_patch.ops.core import deferred_checks, early_checks
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.functional import check_labels_ahead
from liger_patch.ops.cross_entropy.options import LossOptions

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

V = 300


@pytest.fixture(autouse=True)
def _no_check_left():
    yield
    early_checks._AHEAD.clear()


def _case(gen, device):
    """(2, 37) tokens, about a quarter of them ignored (first, last, a run, some at random), H 48, fp32."""
    return make_case(gen, (2, 37), 48, V, device=device, ignore="mixed")


def _step(case, **opts):
    """The loss and its gradients, the leaves' ``.grad`` cleared."""
    loss = call_op(case, **opts)
    loss.sum().backward()
    grads = [t.grad for t in case.grad_leaves().values()]
    for t in case.grad_leaves().values():
        t.grad = None
    return [loss.detach(), *grads]


@pytest.mark.parametrize("num_items", [None, 40, "tensor"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_call_takes_the_check_and_gives_the_same_bits(monkeypatch, gen, device, backend, num_items):
    case = _case(gen, device)
    if num_items == "tensor":
        num_items = torch.tensor(40, device=device)
    opts = dict(backend=backend, num_items_in_batch=num_items)
    expected = _step(case, **opts)
    found = checks_taken_ahead(monkeypatch)
    key = check_labels_ahead(
        case.labels, V, options=LossOptions.from_kwargs(backend=backend), num_items_in_batch=num_items
    )
    assert key is not None and early_checks.waiting()
    assert_same_bits(_step(case, **opts), expected)
    assert found == [True] and not early_checks.waiting()
    assert not early_checks.drop(key)  # taken: nothing left to drop
    ref, _, _ = reference_for(case, num_items_in_batch=num_items)
    assert_close("loss", expected[0], ref, 1e-5)


@pytest.mark.parametrize(
    "change",
    ["labels_in_place", "other_labels", "ignore_index", "reduction", "num_items", "num_items_in_place"],
)  # (for "ignore_index" the check begun ahead has another one)
def test_a_call_that_differs_queues_its_own_check(monkeypatch, gen, device, change):
    """Each difference changes the results, so a call that took the check begun ahead would be
    wrong: here every one is right, and none took it."""
    case = _case(gen, device)
    num_items = torch.tensor(40.0, device=device)
    opts = dict(num_items_in_batch=num_items)
    key = check_labels_ahead(case.labels, V, ignore_index=1 if change == "ignore_index" else -100, **opts)
    if change == "labels_in_place":
        case.labels.view(-1)[:5] = torch.tensor([-100, 7, -100, 9, 11])  # the ignored rows move
    elif change == "other_labels":
        case.labels = case.labels.clone()
        case.labels.view(-1)[:5] = torch.tensor([-100, 7, -100, 9, 11])
    elif change == "reduction":
        opts["reduction"] = "sum"
        opts.pop("num_items_in_batch")
    elif change == "num_items":
        opts["num_items_in_batch"] = torch.tensor(40.0, device=device)  # equal, but another tensor
    else:
        num_items.fill_(25.0)
    found = checks_taken_ahead(monkeypatch)
    loss = call_op(case, **opts)
    assert found == [False]
    ref_opts = {k: v for k, v in opts.items() if k != "num_items_in_batch"}
    items = opts.get("num_items_in_batch")
    ref, _, _ = reference_for(case, num_items_in_batch=None if items is None else float(items), **ref_opts)
    assert_close("loss", loss, ref, 1e-5)
    assert early_checks.drop(key)  # left behind for its caller to drop


def test_a_bad_label_begun_ahead_raises_at_the_call(gen, device):
    case = _case(gen, device)
    case.labels.view(-1)[11] = V
    check_labels_ahead(case.labels, V)
    with pytest.raises(IndexError, match=rf"label {V} at flat position 11 is outside"):
        loss = call_op(case)
        loss.backward()
        deferred_checks.raise_pending()  # on CUDA the call may not have read it


def test_nothing_is_begun_where_no_call_could_take_it(gen, device):
    case = _case(gen, device)
    off = LossOptions.from_kwargs(tuning=Tuning(check_labels_ahead=False))
    assert check_labels_ahead(case.labels, V, options=off) is None
    assert check_labels_ahead(case.labels.int(), V) is None  # the call's would be another tensor
    assert check_labels_ahead(case.labels[:, ::2], V) is None  # the call would copy them
    assert check_labels_ahead(case.labels[:0], V) is None
    assert check_labels_ahead(case.labels, V, num_items_in_batch=-3) is None  # the call raises
    with torch.inference_mode():
        frozen = case.labels.clone()  # inference tensors: no version counter
        frozen_items = torch.tensor(40.0, device=device)
        assert check_labels_ahead(case.labels, V) is None  # under inference mode
    assert check_labels_ahead(frozen, V) is None
    assert check_labels_ahead(case.labels, V, num_items_in_batch=frozen_items) is None
    assert not early_checks.waiting()


def test_a_call_over_inference_tensors_while_a_check_waits(gen, device):
    """Inference tensors have no version counter: no key, so such a call queues its own check."""
    case = _case(gen, device)
    key = check_labels_ahead(case.labels.clone(), V)
    with torch.inference_mode():
        labels = case.labels.clone()
        loss = lp.fused_linear_cross_entropy(case.hidden.detach(), case.weight.detach(), labels)
    ref, _, _ = reference_for(case)
    assert_close("loss", loss, ref, 1e-5)
    assert early_checks.drop(key)


def test_at_most_a_few_checks_wait(gen, device):
    case = _case(gen, device)
    copies = [case.labels.clone() for _ in range(early_checks._MAX_AHEAD + 2)]  # kept: distinct storages
    keys = [check_labels_ahead(labels, V) for labels in copies]
    assert len(early_checks._AHEAD) == early_checks._MAX_AHEAD
    assert not early_checks.drop(keys[0]) and early_checks.drop(keys[-1])


def test_beginning_a_check_ahead_looks_nothing_up(monkeypatch, gen, device):
    """While another check waits, beginning one ahead makes its key once and takes nothing: its
    own check is queued directly, and both wait for their calls."""
    case = _case(gen, device)
    first = check_labels_ahead(case.labels.clone(), V)
    keys = record_calls(monkeypatch, early_checks, "labels_key")
    taken = checks_taken_ahead(monkeypatch)
    second = check_labels_ahead(case.labels, V)
    assert len(keys) == 1 and taken == []
    assert early_checks.drop(first) and early_checks.drop(second)


def test_the_key_names_the_labels_where_they_live(device):
    """Views of one int64 tensor share a key; a copy, or the tensor after a write, does not."""
    labels = torch.arange(12, device=device).view(3, 4)

    def key(t):
        return early_checks.labels_key(t.reshape(-1), V, -100, "mean", (None, None), None)

    first = key(labels)
    assert key(labels.view(12)) == first and key(labels.view(2, 6)) == first
    assert key(labels.clone()) != first
    labels[0, 0] = 5
    assert key(labels) != first


def test_the_functional_op_without_a_check_begun_ahead_is_unchanged(monkeypatch, gen, device):
    case = _case(gen, device)
    found = checks_taken_ahead(monkeypatch)
    lp.fused_linear_cross_entropy(case.hidden, case.weight, case.labels).backward()
    assert found == []  # nothing waits: no key is made


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_check_arrived_ahead_begins_no_head_start_and_gives_the_same_bits(monkeypatch, gen):
    """A call that waits to skip its ignored rows begins its first chunk before the wait (the head
    start) while its own check runs; with the check begun ahead and answered it begins none, and
    its results are the same bits."""
    from liger_patch.ops.core import head_start

    begun, start = [], head_start.start
    monkeypatch.setattr(head_start, "start", lambda *a, **k: begun.append(1) or start(*a, **k))
    case = make_case(gen, (700,), 64, V, device="cuda", dtype=torch.bfloat16, ignore="half")
    tuning = Tuning(wait_to_skip_gflop=0.0, min_token_chunk_rows=0, head_start_gflop=128 * 2 * 64 * V / 1e9)
    opts = dict(backend="triton", tuning=tuning)
    _step(case, **opts)  # the shape's share of ignored labels is read
    expected = _step(case, **opts)
    assert begun, "no head start to leave out"
    begun.clear()
    check_labels_ahead(case.labels, V, options=LossOptions.from_kwargs(**opts))
    torch.cuda.synchronize()
    assert_same_bits(_step(case, **opts), expected)
    assert begun == []
