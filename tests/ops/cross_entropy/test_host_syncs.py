"""On CUDA the op makes at most one host synchronisation per call (the label range check), in the
forward and none in the backward: the training loop keeps running ahead of the GPU. While a CUDA
graph is captured it makes none, so forward and backward can be captured and replayed; a bad
label then poisons the results with NaN instead of raising (docs/loss.md)."""

import warnings

import pytest
import torch
from op_helpers import TOL, assert_close, call_op, capture_step, make_case

import liger_patch as lp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _count_syncs(fn) -> int:
    """Synchronising CUDA calls made by ``fn`` (torch reports each one under sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_at_most_one_sync_in_forward_and_none_in_backward(gen, device, backend, reduction):
    case = make_case(gen, (4, 33), 64, 1000, dtype=torch.bfloat16, device=device, bias=True)
    opts = dict(backend=backend, reduction=reduction, z_loss_scale=1e-4)
    if reduction == "mean":
        opts["num_items_in_batch"] = torch.tensor(100, device=device)
    call_op(case, **opts).sum().backward()  # warm-up: kernel compilation may synchronise
    out = {}

    def forward():
        out["loss"] = call_op(case, **opts)

    assert _count_syncs(forward) <= 1
    upstream = torch.randn_like(out["loss"])
    assert _count_syncs(lambda: (out["loss"] * upstream).sum().backward()) == 0


def _captured_step(backend: str, objective: str, static: dict):
    """Forward + backward of the op on the static tensors; returns the static loss and z-loss."""

    def step():
        out = lp.fused_linear_cross_entropy(
            static["hidden"],
            static["weight"],
            static["labels"],
            static["bias"],
            backend=backend,
            z_loss_scale=1e-3,
            return_z_loss=True,
            num_items_in_batch=static["num_items"],
        )
        (out.loss if objective == "loss" else out.loss + 2.0 * out.z_loss).backward()
        return out.loss.detach(), out.z_loss.detach()

    return step


def _new_values(gen, N, H, V, device):
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.3] = -100
    labels[0] = 1  # at least one kept token
    return {
        "hidden": torch.randn(N, H, generator=gen).to(device),
        "weight": (torch.randn(V, H, generator=gen) * H**-0.5).to(device),
        "bias": (torch.randn(V, generator=gen) * 0.1).to(device),
        "labels": labels.to(device),
        "num_items": torch.tensor(int((labels != -100).sum()) + 3, device=device),
    }


LEAVES = ("hidden", "weight", "bias")


@pytest.mark.parametrize("bad", ["label", "num_items"])
@pytest.mark.parametrize("objective", ["loss", "loss_z"])  # gradients from the forward / recomputed
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_graph_capture_replays_eager_and_poisons_bad_inputs(gen, device, backend, objective, bad):
    """The op, forward and backward, captured in a ``torch.cuda.CUDAGraph`` after a warm-up call
    outside capture: replaying with new values copied into the static tensors gives eager's loss,
    z-loss and gradients; an out-of-range label (or a negative ``num_items_in_batch``) copied in
    makes the replayed loss, z-loss and gradients NaN, with no exception; good values afterwards
    give eager's numbers again."""
    N, H, V = 96, 64, 1000
    static = _new_values(gen, N, H, V, device)
    for name in LEAVES:
        static[name].requires_grad_()
    replay = capture_step(_captured_step(backend, objective, static), static, LEAVES)

    def eager(values):
        leaves = {n: values[n].clone().requires_grad_() for n in LEAVES}
        inputs = {**values, **leaves}
        loss, z_loss = _captured_step(backend, objective, inputs)()
        return loss, z_loss, {n: leaves[n].grad for n in LEAVES}

    def assert_same(values, what):
        (loss, z_loss), grads = replay(values)
        e_loss, e_z, e_grads = eager(values)
        tol = TOL[torch.float32]
        assert_close(f"{what}: loss", loss, e_loss.double(), tol)
        assert_close(f"{what}: z_loss", z_loss, e_z.double(), tol)
        for name in LEAVES:
            assert_close(f"{what}: grad {name}", grads[name], e_grads[name].double(), tol)

    for trial in range(3):
        assert_same(_new_values(gen, N, H, V, device), f"replay {trial}")

    poisoned = _new_values(gen, N, H, V, device)
    kept = poisoned["labels"] != -100
    if bad == "label":
        poisoned["labels"][5] = V  # out of range; eagerly this raises IndexError
        kept[5] = False  # treated as ignored inside the kernels
    else:
        poisoned["num_items"].fill_(-1)  # eagerly this raises ValueError
    (loss, z_loss), grads = replay(poisoned)  # no exception, no crash
    assert torch.isnan(loss) and torch.isnan(z_loss)
    assert torch.isnan(grads["weight"]).all() and torch.isnan(grads["bias"]).all()
    assert torch.isnan(grads["hidden"][kept]).all()

    assert_same(_new_values(gen, N, H, V, device), "replay after the poisoned one")
