"""On CUDA the op does not make the host wait for the GPU (issue 43): behind a busy GPU its
forward and backward return before the GPU has reached them, with the same results as a call that
read its label check, and a bad label raises before an optimizer steps on its NaN gradient
(``core/deferred_checks.py``). Torch's sync debug mode finds no synchronising call in either op,
nor in a patched model's training forward and backward beyond the unpatched model's own. While a
CUDA graph is captured the op makes no sync either, so forward and backward can be captured and
replayed; a bad label then poisons the results with NaN instead of raising (docs/loss.md)."""

import math
import warnings

import pytest
import torch
from op_helpers import TOL, assert_close, call_op, capture_step, make_case

import liger_patch as lp
from liger_patch.ops.core import deferred_checks
from liger_patch.ops.core.tuning import Tuning
from tests.ops.distillation.cases import make_case as distill_case
from tests.patching_helpers import make_batch, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BUSY_CYCLES = 400_000_000  # a GPU spin of ~0.2 s at 2 GHz: far longer than any call's host time


def _behind_busy_gpu(fn):
    """``fn()`` called while the GPU spins; whether the spin was still running when it returned.
    (A kernel's first launch in a process loads its module, which waits for the GPU: a call's
    path must have run once behind a spin before it is measured, ``_warm_behind_busy_gpu``.)"""
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    spun = torch.cuda.Event()
    spun.record()
    result = fn()
    still_busy = not spun.query()
    torch.cuda.synchronize()
    return result, still_busy


# A call that never waits for the GPU returned before the spin ended in all but a few of the
# suite's runs on an H200 with 4 to 16 workers sharing the card; the few (torch and Triton
# backends, no pattern in the options) are not reproduced by the same case alone, so a case
# passes when one of three attempts returns early: a wait in the op fails all three.


def _warm_behind_busy_gpu(fn) -> None:
    """Run ``fn`` as it runs behind a busy GPU (its label check not answered), loading its kernels."""
    _behind_busy_gpu(fn)
    deferred_checks.raise_pending()


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


def _distill_case(gen, device, n=200, share=0.25):
    """200 tokens of a 64- and a 48-wide head over 1000 classes, ``share`` of them ignored."""
    case = distill_case(gen, (n,), 64, 48, 1000, bias=False, ignore="none", device=device)
    case["labels"][torch.rand(n, generator=gen).to(device) < share] = -100
    return case


def _ce_step(case, **opts):
    def step():
        loss = call_op(case, **opts)
        loss.sum().backward()
        return loss.detach()

    return step


def _distill_step(case, **opts):
    def step():
        loss = lp.fused_linear_distillation(**case, beta=0.5, ce_weight=0.3, **opts)
        loss.sum().backward()
        return loss.detach()

    return step


def _grads(leaves):
    out = {n: t.grad.clone() for n, t in leaves.items()}
    for t in leaves.values():
        t.grad = None
    return out


@pytest.mark.parametrize("share", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("op", ["cross_entropy", "distillation"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_behind_a_busy_gpu_the_host_does_not_wait_and_results_are_the_same(
    gen, device, backend, op, reduction, share
):
    """The call returns while the GPU still spins, and its loss and gradients equal those of the
    same call that waits for its label check (``wait_to_skip_gflop`` 0) and skips the ignored
    rows where 25 % are."""
    read = Tuning(wait_to_skip_gflop=0.0)
    if op == "cross_entropy":
        case = make_case(gen, (3, 67), 64, 1000, device=device, bias=True, ignore="none")
        case.labels[torch.rand(case.labels.shape, generator=gen).to(device) < share] = -100
        leaves, step = case.grad_leaves(), _ce_step(case, backend=backend, reduction=reduction)
        reference = _ce_step(case, backend=backend, reduction=reduction, tuning=read)
    else:
        case = _distill_case(gen, device, share=share)
        leaves = {k: case[k] for k in ("student_hidden", "student_weight")}
        step = _distill_step(case, backend=backend, reduction=reduction)
        reference = _distill_step(case, backend=backend, reduction=reduction, tuning=read)
    _warm_behind_busy_gpu(step)
    _grads(leaves)
    for _ in range(3):  # see the note above _warm_behind_busy_gpu
        loss, still_busy = _behind_busy_gpu(step)
        assert deferred_checks.pending() == 1
        grads = _grads(leaves)
        deferred_checks.raise_pending()
        if still_busy:
            break
    assert still_busy, "the call waited for the GPU three times out of three"
    ref_loss = reference()  # the check read (waited for) and the kept rows skipped where 25 % are ignored
    assert deferred_checks.pending() == 0
    tol = TOL[torch.float32]
    assert_close("loss", loss, ref_loss.double(), tol)
    for name, ref in _grads(leaves).items():
        assert_close(f"grad {name}", grads[name], ref.double(), tol)


@pytest.mark.parametrize("op", ["cross_entropy", "distillation"])
def test_behind_a_busy_gpu_a_bad_label_raises_before_the_optimizer_steps(gen, device, op):
    if op == "cross_entropy":
        case = make_case(gen, (2, 50), 64, 1000, device=device, bias=True)
        params, labels, step = list(case.grad_leaves().values()), case.labels, _ce_step(case)
    else:
        case = _distill_case(gen, device)
        params, labels = [case["student_hidden"], case["student_weight"]], case["labels"]
        step = _distill_step(case)
    _warm_behind_busy_gpu(step)  # good labels
    labels.view(-1)[57] = 1000
    for p in params:
        p.grad = None
    before = [p.detach().clone() for p in params]
    loss, still_busy = _behind_busy_gpu(step)  # no exception: the GPU had not checked the labels
    assert still_busy and torch.isnan(loss).all()
    optimizer = torch.optim.AdamW(params, lr=0.1)
    with pytest.raises(IndexError, match=r"label 1000 at flat position 57 is outside \[0, 1000\)"):
        optimizer.step()
    for p, b in zip(params, before, strict=True):
        assert torch.equal(p.detach(), b), "the optimizer stepped on the NaN gradient"


def test_a_large_call_with_ignored_labels_waits_to_skip_them(gen, device):
    """Above ``Tuning.wait_to_skip_gflop`` of GEMMs saved (here 0: any), a call whose shape last
    had ignored labels waits for its check and walks only the kept rows; with ``inf`` it never
    waits."""
    case = make_case(gen, (300,), 64, 1000, device=device, ignore="half")
    for tuning, waits in ((Tuning(wait_to_skip_gflop=0), True), (Tuning(wait_to_skip_gflop=math.inf), False)):
        step = _ce_step(case, tuning=tuning)
        _warm_behind_busy_gpu(step)
        _, still_busy = _behind_busy_gpu(step)
        assert still_busy is not waits
        deferred_checks.raise_pending()


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_sync_in_forward_or_backward(gen, device, backend, reduction):
    case = make_case(gen, (4, 33), 64, 1000, dtype=torch.bfloat16, device=device, bias=True)
    opts = dict(backend=backend, reduction=reduction, z_loss_scale=1e-4)
    if reduction == "mean":
        opts["num_items_in_batch"] = torch.tensor(100, device=device)
    call_op(case, **opts).sum().backward()  # warm-up: kernel compilation may synchronise
    out = {}

    def forward():
        out["loss"] = call_op(case, **opts)

    assert _count_syncs(forward) == 0
    upstream = torch.randn_like(out["loss"])
    assert _count_syncs(lambda: (out["loss"] * upstream).sum().backward()) == 0
    deferred_checks.raise_pending()
    distill = _distill_step(_distill_case(gen, device), backend=backend, reduction=reduction)
    distill()
    assert _count_syncs(distill) == 0
    deferred_checks.raise_pending()


def test_a_patched_training_step_waits_no_more_than_unpatched(device):
    """Torch's sync debug mode counts no more synchronising calls in a patched step than in an
    unpatched one; and behind a busy GPU a patched forward + backward returns before the GPU is
    done with the spin wherever the unpatched one does."""
    model = tiny_model("llama").to(device)
    batch = {k: v.to(device) for k, v in make_batch().items() if k != "attention_mask"}
    batch["labels"][:, :5] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def forward_backward():
        model(**batch).loss.backward()

    step()
    unpatched = _count_syncs(step)
    _warm_behind_busy_gpu(forward_backward)
    _, unpatched_returned_early = _behind_busy_gpu(forward_backward)
    optimizer.zero_grad()
    with lp.liger_patched(model):
        step()
        assert _count_syncs(step) <= unpatched
        _warm_behind_busy_gpu(forward_backward)
        _, still_busy = _behind_busy_gpu(forward_backward)
        assert still_busy or not unpatched_returned_early, "the patched forward and backward waited"
        optimizer.zero_grad()
    deferred_checks.raise_pending()


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
