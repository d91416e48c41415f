"""The distillation op, forward and backward, captured in a ``torch.cuda.CUDAGraph``: replaying it
with new values copied into the static tensors gives eager's loss and student gradients; a bad
label (or ``num_items_in_batch``) makes them NaN instead of raising; good values afterwards give
eager's numbers again. The cross-entropy op's test (tests/ops/cross_entropy/test_host_syncs.py)
for the label check both ops share (``core/kept_rows.py``); on CPU its contract is checked by
tests/ops/distillation/test_label_check.py."""

import pytest
import torch
from op_helpers import TOL, assert_close, capture_step

import liger_patch as lp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N, HS, HT, V = 96, 64, 48, 1000
STUDENT = ("student_hidden", "student_weight", "student_bias")


def _new_values(gen, device):
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.3] = -100
    labels[0] = 1  # at least one kept token
    values = {
        "student_hidden": torch.randn(N, HS, generator=gen),
        "student_weight": torch.randn(V, HS, generator=gen) * HS**-0.5,
        "student_bias": torch.randn(V, generator=gen) * 0.1,
        "teacher_hidden": torch.randn(N, HT, generator=gen),
        "teacher_weight": torch.randn(V, HT, generator=gen) * HT**-0.5,
        "labels": labels,
        "num_items": torch.tensor(float((labels != -100).sum()) + 3.0),
    }
    return {name: t.to(device) for name, t in values.items()}


def _step(backend: str, reduction: str, static: dict):
    """Forward + backward of the op on the static tensors; returns the static loss."""

    def step():
        loss = lp.fused_linear_distillation(
            static["student_hidden"],
            static["student_weight"],
            static["teacher_hidden"],
            static["teacher_weight"],
            static["labels"],
            static["student_bias"],
            beta=0.5,
            ce_weight=0.2,
            backend=backend,
            reduction=reduction,
            num_items_in_batch=static["num_items"] if reduction == "mean" else None,
        )
        loss.sum().backward()
        return loss.detach()

    return step


@pytest.mark.parametrize("bad", ["label", "num_items"])
@pytest.mark.parametrize("reduction", ["mean", "none"])  # gradients from the forward / recomputed
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_graph_capture_replays_eager_and_poisons_bad_inputs(gen, device, backend, reduction, bad):
    if bad == "num_items" and reduction == "none":
        pytest.skip("num_items_in_batch is the divisor of reduction 'mean'")
    static = _new_values(gen, device)
    for name in STUDENT:
        static[name].requires_grad_()
    replay = capture_step(_step(backend, reduction, static), static, STUDENT)

    def eager(values):
        leaves = {n: values[n].clone().requires_grad_() for n in STUDENT}
        loss = _step(backend, reduction, {**values, **leaves})()
        return loss, {n: leaves[n].grad for n in STUDENT}

    def assert_same(values, what):
        ((loss,), grads), (e_loss, e_grads) = replay(values), eager(values)
        assert_close(f"{what}: loss", loss, e_loss.double(), TOL[torch.float32])
        for name in STUDENT:
            assert_close(f"{what}: grad {name}", grads[name], e_grads[name].double(), TOL[torch.float32])

    for trial in range(3):
        assert_same(_new_values(gen, device), f"replay {trial}")
    poisoned = _new_values(gen, device)
    if bad == "label":
        poisoned["labels"][5] = V  # out of range; eagerly this raises IndexError
    else:
        poisoned["num_items"].fill_(-1)  # eagerly this raises ValueError
    (loss,), grads = replay(poisoned)  # no exception, no crash
    assert torch.isnan(loss).all()
    assert torch.isnan(grads["student_weight"]).all() and torch.isnan(grads["student_bias"]).all()
    assert_same(_new_values(gen, device), "replay after the poisoned one")
