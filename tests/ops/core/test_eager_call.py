"""The eager twins of the registered operators (``ops/core/eager_call.py``): taken exactly where a
call is plain eager, and giving the registered operator's results bit for bit (loss, every
output, every gradient, both backward paths)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import liger_patch as lp
from liger_patch.ops.core import forward_grads
from liger_patch.ops.core.eager_call import EagerOp, EmptyOutputs, runs_plainly
from liger_patch.ops.cross_entropy import operator as ce_operator
from liger_patch.ops.cross_entropy import recompute
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.distillation import operator as distill_operator

N, H, V = 37, 16, 50


def _inputs(gen, device, dtype=torch.float32):
    hidden = torch.randn(N, H, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / 4).to(device, dtype).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[torch.rand(N, generator=gen) < 0.3] = -100
    return hidden, weight, labels.to(device)


def test_plain_tensors_run_plainly(gen, device):
    hidden, weight, labels = _inputs(gen, device)
    assert runs_plainly((hidden, weight, labels, None, "key", [True]))
    assert runs_plainly((torch.nn.Parameter(weight.detach()),))


def test_anything_else_takes_the_registered_operator(gen, device):
    hidden, weight, _ = _inputs(gen, device)
    with FakeTensorMode():
        fake = torch.empty(3)
        assert not runs_plainly((fake,))
    with torch.device(device):  # a torch function mode
        assert not runs_plainly((hidden,))
    seen = []
    torch.func.grad(lambda x: seen.append(runs_plainly((x,))) or x.sum())(hidden.detach())
    assert seen == [False]
    seen.clear()

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x):
        return x * 2 if runs_plainly((x,)) else x * 3

    assert torch.equal(traced(hidden.detach()), hidden.detach() * 3)


def _node_names(t: torch.Tensor) -> str:
    """The names of the autograd nodes behind ``t``, joined."""
    names, todo = [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.append(node.name())
            todo.extend(next_node for next_node, _ in node.next_functions)
    return " ".join(names)


def _run(monkeypatch, op_call, hidden, weight, labels, **options):
    """Loss, outputs and grads of one forward + backward through ``op_call`` (the twin or the op)."""
    monkeypatch.setattr(ce_operator, "FLCE", op_call)
    hidden.grad = weight.grad = None
    out = lp.fused_linear_cross_entropy(hidden, weight, labels, **options)
    loss = out if isinstance(out, torch.Tensor) else out[0]
    (loss.sum() if loss.dim() else loss).backward()
    return out, hidden.grad.clone(), weight.grad.clone(), _node_names(loss)


def _tensors(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize(
    "options",
    [{}, {"reduction": "none"}, {"reduction": "sum", "z_loss_scale": 1e-3, "return_z_loss": True}],
    ids=["mean", "none", "sum-z"],
)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_twin_gives_the_registered_operators_bits(gen, device, monkeypatch, backend, options):
    hidden, weight, labels = _inputs(gen, device)
    eager_op = ce_operator.FLCE
    registered = _run(
        monkeypatch, torch.ops.liger_patch.flce, hidden, weight, labels, backend=backend, **options
    )
    twin = _run(monkeypatch, eager_op, hidden, weight, labels, backend=backend, **options)
    assert "eager" in twin[3] and "eager" not in registered[3], (twin[3], registered[3])
    for a, b in zip(registered[:3], twin[:3], strict=True):
        for x, y in zip(_tensors(a), _tensors(b), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("shared", [False, True])
def test_empty_outputs_one_tensor_per_dtype_only_where_shared(device, shared):
    empties = EmptyOutputs(torch.device(device), shared=shared)
    made = [empties(torch.float32), empties(torch.int64), empties(torch.float32), empties(torch.int64)]
    for t, dtype in zip(made, (torch.float32, torch.int64) * 2, strict=True):
        assert t.shape == (0,) and t.dtype == dtype and t.device.type == torch.device(device).type
    assert (made[0] is made[2] and made[1] is made[3]) == shared
    assert made[0] is not made[1]


def test_twin_shares_the_empty_outputs_and_the_operator_does_not(gen, device):
    """Outputs not asked for: one empty tensor per dtype from the twin (fewer allocations), each
    its own from the registered operator, whose outputs may not alias (the aliasing check runs)."""
    hidden, weight, labels = _inputs(gen, device)
    args = (hidden, weight, None, labels, None, None, None, LossOptions().key, [True, True, False])
    twin = ce_operator.FLCE(*args)
    registered = torch.ops.liger_patch.flce(*args)
    torch.library.opcheck(torch.ops.liger_patch.flce.default, args, test_utils=("test_schema",))
    # argmax (int64); the z-loss, entropy, token_scale and the bias, u and B gradients (fp32):
    # asked for by none. The registered operator's z-loss is a 0-d zero (its schema's shape).
    twin_empties = [twin[i] for i in (1, 2, 3, 6, 9, 10, 11)]
    assert all(t.numel() == 0 for t in twin_empties)
    assert len({id(t) for t in twin_empties}) == 2
    assert len({id(registered[i]) for i in (2, 3, 6, 9, 10, 11)}) == 6
    assert registered[1].shape == () and registered[1].item() == 0.0
    for i, (x, y) in enumerate(zip(registered, twin, strict=True)):
        assert i == 1 or torch.equal(x, y)


def test_distillation_twin_gives_the_registered_operators_bits(gen, device, monkeypatch):
    student_h, student_w, labels = _inputs(gen, device)
    teacher_h, teacher_w, _ = _inputs(gen, device)
    results = []
    for op_call in (torch.ops.liger_patch.fused_distill, distill_operator.FUSED_DISTILL):
        monkeypatch.setattr(distill_operator, "FUSED_DISTILL", op_call)
        student_h.grad = student_w.grad = None
        loss = lp.fused_linear_distillation(
            student_h, student_w, teacher_h.detach(), teacher_w.detach(), labels
        )
        loss.backward()
        results.append((_node_names(loss), loss.detach(), student_h.grad.clone(), student_w.grad.clone()))
    (registered_name, *registered), (twin_name, *twin) = results
    assert "eager" in twin_name and "eager" not in registered_name
    for x, y in zip(registered, twin, strict=True):
        assert torch.equal(x, y)


def test_a_list_arguments_tensors_decide_too(gen, device):
    plain = _inputs(gen, device)[0].detach()
    assert runs_plainly(([plain, plain], "torch"))
    with FakeTensorMode():
        fake = torch.empty(3)
    assert not runs_plainly(([plain, fake], "torch"))  # a tensor subclass, in the list only


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backward_operators_run_plainly_with_the_registered_bits(gen, device, backend):
    """The operators without an autograd formula run their implementation in plain eager (under
    no_grad, as the registration's outputs carry no graph) and give the registered one's bits."""
    hidden, weight, labels = _inputs(gen, device)
    key = LossOptions(reduction="none", backend=backend).key
    lse = torch.logsumexp(hidden.detach() @ weight.detach().T, dim=-1)
    coef = torch.rand(N, generator=gen).to(device)
    args = (hidden, weight, None, labels, None, lse, coef, coef * 2, None, None, key, [True, True, False])
    called = []
    impl = recompute.FLCE_BACKWARD.impl
    spied = EagerOp(recompute.FLCE_BACKWARD.op, lambda *a: called.append(torch.is_grad_enabled()) or impl(*a))
    twin = spied(*args)
    assert called == [False]
    assert torch.equal(recompute.FLCE_BACKWARD(*args)[0], twin[0])
    with torch.no_grad():  # a backward's call: grad mode is left as it is
        spied(*args)
    assert called == [False, False]
    registered = torch.ops.liger_patch.flce_backward(*args)
    for x, y in zip(registered, twin, strict=True):
        assert torch.equal(x, y) and not y.requires_grad

    grads = [torch.randn(5, H, generator=gen).to(device), torch.randn(V, H, generator=gen).to(device)]
    copies = [g.clone() for g in grads]
    scale = torch.tensor(0.37, device=device)
    assert forward_grads.SCALE_GRADS(grads, scale, backend) is None
    torch.ops.liger_patch.scale_grads_(copies, scale, backend)
    for x, y in zip(grads, copies, strict=True):
        assert torch.equal(x, y)
