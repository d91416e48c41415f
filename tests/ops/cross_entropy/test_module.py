"""The nn.Module form, lp.FusedLinearCrossEntropyLoss(**options)(hidden, weight, labels, bias=None)."""

import pytest
import torch
from op_helpers import BACKENDS, TOL, assert_close, call_op, check_parity, make_case, reference_for

import liger_patch as lp

FP32 = TOL[torch.float32]

MODULE_OPTIONS = {
    "defaults": {},
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
    "combined": dict(ignore_index=-1, label_smoothing=0.1, z_loss_scale=1e-2, softcap=5.0, logit_scale=0.8),
    "num_items": dict(num_items_in_batch=40),
}


@pytest.mark.parametrize("opt_id", list(MODULE_OPTIONS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_module_matches_functional_and_reference(gen, device, chunk_rows, backend, opt_id):
    tuned = chunk_rows(3, 97)
    opts = dict(MODULE_OPTIONS[opt_id], backend=backend)
    ignore_index = opts.get("ignore_index", -100)
    case = make_case(gen, (2, 9), 19, 97, device=device, bias=True, ignore_index=ignore_index)
    module = lp.FusedLinearCrossEntropyLoss(**opts, **tuned)
    assert isinstance(module, torch.nn.Module)
    out = module(case.hidden, case.weight, case.labels, case.bias)
    functional = call_op(case, **opts, **tuned)
    torch.testing.assert_close(out, functional, rtol=0, atol=0)
    out.sum().backward()  # the module output is differentiable
    for t in case.tensors().values():
        t.grad = None
    check_parity(case, gen, tol=FP32, **opts, **tuned)  # functional path: values + grads vs fp64


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_grads_match_reference(gen, device, backend):
    """Gradients through the module itself, with a random upstream, against fp64."""
    case = make_case(gen, (2, 9), 19, 97, device=device, bias=True)
    opts = dict(label_smoothing=0.1, z_loss_scale=1e-2, softcap=5.0, reduction="none")
    module = lp.FusedLinearCrossEntropyLoss(backend=backend, **opts)
    loss = module(case.hidden, case.weight, case.labels, case.bias)
    g = torch.randn(loss.shape, generator=gen, dtype=torch.float64)
    (loss * g.to(device, loss.dtype)).sum().backward()

    ref, _, leaves = reference_for(case, **opts)
    grads = torch.autograd.grad((ref * g).sum(), list(leaves.values()))
    assert_close("loss", loss, ref, FP32)
    for (name, t), rg in zip(case.tensors().items(), grads, strict=True):
        assert_close(f"grad {name}", t.grad, rg, FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_return_z_loss(gen, device, backend):
    case = make_case(gen, (11,), 19, 97, device=device, requires_grad=())
    module = lp.FusedLinearCrossEntropyLoss(z_loss_scale=2e-2, return_z_loss=True, backend=backend)
    loss, z = module(case.hidden, case.weight, case.labels)
    ref_loss, ref_z = call_op(case, z_loss_scale=2e-2, return_z_loss=True, backend=backend)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    torch.testing.assert_close(z, ref_z, rtol=0, atol=0)


def test_module_without_bias_argument(gen, device):
    case = make_case(gen, (11,), 19, 97, device=device, requires_grad=())
    loss = lp.FusedLinearCrossEntropyLoss()(case.hidden, case.weight, case.labels)
    torch.testing.assert_close(loss, call_op(case), rtol=0, atol=0)


def test_module_has_no_parameters_or_state():
    module = lp.FusedLinearCrossEntropyLoss(label_smoothing=0.1)
    assert list(module.parameters()) == []
    assert module.state_dict() == {}


@pytest.mark.parametrize(
    "opts",
    [
        dict(reduction="avg"),
        dict(softcap=0.0),
        dict(label_smoothing=2.0),
        dict(backend="nope"),
        dict(reduction="sum", num_items_in_batch=3),
    ],
    ids=["reduction", "softcap", "smoothing", "backend", "num_items"],
)
def test_module_rejects_bad_options(gen, device, opts):
    """At construction or at the latest at the first call."""
    case = make_case(gen, (5,), 19, 97, device=device, requires_grad=())
    with pytest.raises(ValueError):
        module = lp.FusedLinearCrossEntropyLoss(**opts)
        module(case.hidden, case.weight, case.labels)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_forward_num_items_overrides_constructor(gen, device, backend):
    """num_items_in_batch changes every batch, so forward takes it too and it wins."""
    case = make_case(gen, (2, 9), 19, 97, device=device, bias=True)
    module = lp.FusedLinearCrossEntropyLoss(num_items_in_batch=1000, backend=backend)
    n = torch.tensor(31, device=device)
    loss = module(case.hidden, case.weight, case.labels, case.bias, num_items_in_batch=n)
    loss.backward()
    ref, _, leaves = reference_for(case, num_items_in_batch=31)
    assert_close("loss", loss, ref, FP32)
    grads = torch.autograd.grad(ref, list(leaves.values()))
    for (name, t), rg in zip(case.tensors().items(), grads, strict=True):
        assert_close(f"grad {name}", t.grad, rg, FP32)
