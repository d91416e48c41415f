"""The distillation op's label check is the cross-entropy op's (``core/kept_rows.py``): the same
skip share (``Tuning.skip_ignored_share``) decides whether its chunks gather the kept rows or walk
every row, and while a CUDA graph is captured it makes no host sync, walks every row, and turns a
bad label (or ``num_items_in_batch``) into NaN results instead of an exception. Before issue 42
the distillation op had its own check: it always gathered the kept rows and, under capture,
waited for the check's values (illegal there) and read a ``nonzero`` in its backward.

On CPU a capture is stood in for by ``kept_rows.capturing`` answering True (the predicate every
caller asks), with every wait for the device made to fail; tests/ops/distillation/test_capture.py
captures a real CUDA graph where there is a GPU."""

import contextlib

import pytest
import torch
from op_helpers import BACKENDS, raises_by_step

import liger_patch as lp
from liger_patch.ops.core import deferred_checks, kept_rows, validation
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.distillation import operator
from tests.ops.distillation.cases import FP32, loss_and_grads, make_case, on_device

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

N = 24
OPTS = dict(beta=0.4, ce_weight=0.3, temperature=1.5, student_softcap=4.0)
SHARE_RULE = Tuning(wait_to_skip_gflop=0.0)  # always read the check, skip by the share
GATHER = Tuning(skip_ignored_share=0.0, wait_to_skip_gflop=0.0)  # gather whenever one is ignored


@pytest.fixture
def walks(monkeypatch):
    """For each ``run_distill`` call: whether it walked every row (``kept`` is ``None``)."""
    calls = []
    real = operator.run_distill

    def spied(call):
        calls.append(call.kept is None)
        return real(call)

    monkeypatch.setattr(operator, "run_distill", spied)
    return calls


@contextlib.contextmanager
def captured():
    """``kept_rows.capturing`` answering True, and every host sync the op could make failing
    (label checks an earlier call left unread are read first: a capture begins after them)."""
    deferred_checks.raise_pending()

    def no_wait(self, *args, **kwargs):
        raise AssertionError("the label check waited for its values while a graph is captured")

    def no_nonzero(*args, **kwargs):
        raise AssertionError("nonzero (a host sync) while a graph is captured")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kept_rows, "capturing", lambda labels: True)
        mp.setattr(validation.ValueCheck, "result", no_wait)
        mp.setattr(torch, "nonzero", no_nonzero)
        yield


def _case(gen, ignored: int, device):
    case = make_case(gen, (N,), ignore="none")
    case["labels"][:ignored] = -100
    return on_device(case, device)


def _assert_same(actual, expected):
    (loss, grads), (ref, ref_grads) = actual, expected
    torch.testing.assert_close(loss, ref, rtol=FP32, atol=FP32)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=FP32, atol=FP32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("ignored", "every_row"), [(0, True), (1, True), (6, False)])
def test_the_skip_share_decides_as_for_cross_entropy(gen, device, backend, walks, ignored, every_row):
    """1 of 24 ignored (4 %) is under the default share of 5 %: every row is walked, the ignored
    one giving 0, as in the cross-entropy op; 6 of 24 gather the kept rows (the check always
    read: ``wait_to_skip_gflop`` 0). Results equal those of gathering whenever a row is ignored
    (share 0) to fp32 rounding."""
    case = _case(gen, ignored, device)
    upstream = (torch.rand((), generator=gen) + 0.5).to(device)
    result = loss_and_grads(
        lp.fused_linear_distillation, case, upstream, backend=backend, tuning=SHARE_RULE, **OPTS
    )
    gathered = loss_and_grads(
        lp.fused_linear_distillation, case, upstream, backend=backend, tuning=GATHER, **OPTS
    )
    assert walks == [every_row, ignored == 0]
    _assert_same(result, gathered)


@pytest.mark.parametrize("reduction", ["mean", "none"])  # gradients from the forward / recomputed
@pytest.mark.parametrize("backend", BACKENDS)
def test_under_capture_no_sync_every_row_and_the_eager_results(gen, device, backend, reduction, walks):
    """Forward and (recomputing) backward take kept_rows' capture path: no wait, no nonzero, every
    row walked; the loss and the student's gradients are eager's."""
    case = _case(gen, 5, device)
    upstream = (torch.rand(() if reduction == "mean" else (N,), generator=gen) + 0.5).to(device)
    opts = dict(OPTS, backend=backend, reduction=reduction)
    eager = loss_and_grads(lp.fused_linear_distillation, case, upstream, **opts)
    walks.clear()
    with captured():
        result = loss_and_grads(lp.fused_linear_distillation, case, upstream, **opts)
    assert walks == [True] * (1 if reduction == "mean" else 2)
    _assert_same(result, eager)


@pytest.mark.parametrize(
    ("bad", "reduction"), [("label", "mean"), ("num_items", "mean"), ("label", "none")]
)  # gradients from the forward; recomputed by the backward, which must not index with the label
@pytest.mark.parametrize("op", ["cross_entropy", "distillation"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_under_capture_a_bad_input_poisons_both_ops_alike(gen, device, backend, op, bad, reduction):
    """What eagerly raises (a label outside [0, V), a negative ``num_items_in_batch`` tensor)
    makes the loss and every gradient NaN under capture (an ignored row's grad_h stays 0), and
    raises nothing: the cross-entropy op's contract, which the distillation op now keeps too.
    With reduction "none" the backward recomputes from the saved labels: it must see the bad
    one as the forward did, ignored (on a GPU it indexed with it: a device-side assert)."""
    case = _case(gen, 3, device)
    num_items = None
    if reduction == "mean":
        num_items = torch.tensor(-1.0 if bad == "num_items" else 21.0, device=device)
    if bad == "label":
        case["labels"][7] = case["student_weight"].shape[0]  # out of range
    opts = dict(backend=backend, num_items_in_batch=num_items, reduction=reduction)
    if op == "cross_entropy":
        inputs = (case["student_hidden"], case["student_weight"], case["labels"], case["student_bias"])

        def call():
            return lp.fused_linear_cross_entropy(*inputs, **opts)
    else:

        def call():
            return lp.fused_linear_distillation(**case, **opts, **OPTS)

    with raises_by_step(IndexError if bad == "label" else ValueError):
        call()
    leaves = [case[k] for k in ("student_hidden", "student_weight", "student_bias")]
    with captured():
        loss = call()
        grads = torch.autograd.grad(loss.sum(), leaves)
    assert torch.isnan(loss).all()
    grad_h, grad_w, grad_b = grads
    assert torch.isnan(grad_w).all() and torch.isnan(grad_b).all()
    ignored = case["labels"] == -100
    if bad == "label":
        ignored[7] = True  # turned into an ignored row
    assert torch.isnan(grad_h[~ignored]).all() and (grad_h[ignored] == 0).all()
