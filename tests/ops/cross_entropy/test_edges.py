"""Edges of issue #2, section 3, each its own test: nothing kept, grads only where required,
no-grad calls, z-loss identity, gradient accumulation, non-contiguous and unmodified inputs,
autocast."""

import pytest
import torch
from op_helpers import (
    BACKENDS,
    TOL,
    Case,
    assert_close,
    call_op,
    call_raw,
    check_parity,
    make_case,
    materialize_options,
    reference_for,
)

from liger_patch.ops.reference import reference_flce

FP32 = TOL[torch.float32]


# ---------------------------------------------------------------- nothing kept / zero tokens

NOTHING_KEPT_REDUCTIONS = {
    "mean": dict(reduction="mean"),
    "mean-num_items_0": dict(reduction="mean", num_items_in_batch=0),
    "mean-num_items_int_tensor_0": dict(reduction="mean", num_items_in_batch=("tensor", 0, torch.int64)),
    "mean-num_items_float_tensor_0": dict(
        reduction="mean", num_items_in_batch=("tensor", 0.0, torch.float32)
    ),
    "mean-num_items_7": dict(reduction="mean", num_items_in_batch=7),
    "sum": dict(reduction="sum"),
    "none": dict(reduction="none"),
}
NOTHING_KEPT_INPUTS = {
    "all_ignored": (5,),
    "all_ignored_2d": (2, 3),
    "zero_tokens": (0,),
    "zero_tokens_2d": (3, 0),
}


def _check_nothing_kept(case, gen, **opts):
    out = call_op(case, **opts)
    loss, z = out if opts.get("return_z_loss") else (out, None)
    lead = case.labels.shape
    expected_shape = lead if opts.get("reduction") == "none" else ()
    assert tuple(loss.shape) == tuple(expected_shape)
    assert torch.isfinite(loss).all(), f"loss not finite: {loss}"
    assert (loss == 0).all(), f"loss must be exactly 0 when nothing is kept, got {loss}"
    assert loss.requires_grad and loss.grad_fn is not None, "loss must stay attached to the graph"
    if z is not None:
        assert torch.isfinite(z).all() and (z == 0).all(), f"z_loss must be 0, got {z}"
    upstream = torch.randn(loss.shape, generator=gen).to(loss.device, loss.dtype)
    obj = (loss * upstream).sum()
    if z is not None and z.requires_grad:
        obj = obj + 3.0 * z.sum()
    obj.backward()
    for name, t in case.tensors().items():
        if t.requires_grad:
            assert t.grad is not None, f"{name}.grad is None: DDP/FSDP would hang"
            assert t.grad.shape == t.shape and t.grad.dtype == t.dtype
            assert torch.isfinite(t.grad).all() and (t.grad == 0).all(), f"{name}.grad must be zero"
        else:
            assert t.grad is None


@pytest.mark.parametrize("red_id", list(NOTHING_KEPT_REDUCTIONS))
@pytest.mark.parametrize("inp_id", list(NOTHING_KEPT_INPUTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_kept_is_exact_zero_with_zero_grads(gen, device, backend, inp_id, red_id):
    case = make_case(gen, NOTHING_KEPT_INPUTS[inp_id], 19, 97, device=device, bias=True, ignore="all")
    _check_nothing_kept(
        case, gen, backend=backend, **materialize_options(NOTHING_KEPT_REDUCTIONS[red_id], device)
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_kept_with_every_option(gen, device, chunk_rows, backend, reduction):
    tuned = chunk_rows(2, 97)
    case = make_case(gen, (7,), 19, 97, device=device, bias=True, ignore="all", ignore_index=-1)
    _check_nothing_kept(
        case,
        gen,
        backend=backend,
        reduction=reduction,
        ignore_index=-1,
        label_smoothing=0.2,
        z_loss_scale=1e-2,
        softcap=5.0,
        logit_scale=0.5,
        return_z_loss=True,
        **tuned,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_kept_half_precision(gen, device, backend, dtype):
    case = make_case(gen, (6,), 19, 97, dtype=dtype, device=device, bias=True, ignore="all")
    _check_nothing_kept(case, gen, backend=backend, num_items_in_batch=0)


@pytest.mark.parametrize("requires", [("hidden",), ("weight",), ("bias",)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nothing_kept_grads_only_where_required(gen, device, backend, requires):
    case = make_case(gen, (0,), 19, 97, device=device, bias=True, requires_grad=requires)
    _check_nothing_kept(case, gen, backend=backend)


# ---------------------------------------------------------------- which grads, no-grad calls

REQUIRES = [("hidden",), ("weight",), ("bias",), ("weight", "bias"), ("hidden", "bias"), ("hidden", "weight")]


@pytest.mark.parametrize("requires", REQUIRES, ids="+".join)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grads_only_where_required(gen, device, chunk_rows, backend, requires):
    tuned = chunk_rows(3, 97)
    case = make_case(gen, (2, 7), 19, 97, device=device, bias=True, requires_grad=requires)
    check_parity(case, gen, tol=FP32, backend=backend, label_smoothing=0.1, softcap=6.0, **tuned)
    for name, t in case.tensors().items():
        if name not in requires:
            assert t.grad is None, f"{name} does not require grad but got .grad"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_input_requires_grad(gen, device, backend):
    case = make_case(gen, (2, 7), 19, 97, device=device, bias=True, requires_grad=())
    loss = call_op(case, backend=backend)
    assert not loss.requires_grad and loss.grad_fn is None
    ref, _, _ = reference_for(case)
    assert_close("loss", loss, ref, FP32)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_call(gen, device, chunk_rows, backend, reduction, mode):
    tuned = chunk_rows(3, 97)
    case = make_case(gen, (2, 7), 19, 97, device=device, bias=True)
    opts = dict(
        backend=backend, reduction=reduction, z_loss_scale=1e-2, return_z_loss=True, label_smoothing=0.1
    )
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        loss, z = call_op(case, **opts, **tuned)
    assert loss.grad_fn is None and not loss.requires_grad
    assert z.grad_fn is None and not z.requires_grad
    ref, ref_z, _ = reference_for(case, **opts)
    assert_close("loss", loss, ref, FP32)
    assert_close("z_loss", z, ref_z, FP32)
    for name, t in case.tensors().items():
        assert t.grad is None, f"{name}.grad written by a no-grad call"


# ---------------------------------------------------------------- z-loss


@pytest.mark.parametrize("extra", ["plain", "with_options"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_z_loss_is_the_term_added_to_loss(gen, device, chunk_rows, backend, reduction, extra):
    """loss(z_loss_scale=k) - loss(z_loss_scale=0) == returned z_loss == reference z term."""
    tuned = chunk_rows(3, 97)
    case = make_case(gen, (2, 9), 19, 97, device=device, bias=True, requires_grad=())
    opts = dict(backend=backend, reduction=reduction)
    if extra == "with_options":
        opts.update(label_smoothing=0.1, softcap=4.0, logit_scale=1.3)
        if reduction == "mean":
            opts["num_items_in_batch"] = 29
    k = 3e-2
    loss_k, z = call_op(case, z_loss_scale=k, return_z_loss=True, **opts, **tuned)
    loss_0 = call_op(case, z_loss_scale=0.0, **opts, **tuned)
    _, ref_z, _ = reference_for(case, z_loss_scale=k, **opts)
    assert float(ref_z.abs().max()) > 0.1  # the term is not negligible
    assert_close("z_loss", z, ref_z, FP32)
    scale = float(loss_k.detach().abs().max())
    torch.testing.assert_close(
        (loss_k - loss_0).double().cpu(), z.double().cpu(), rtol=FP32, atol=FP32 * scale
    )
    if reduction == "none":
        ignored = case.labels == case.ignore_index
        assert (z[ignored] == 0).all(), "z_loss must be 0 at ignored tokens"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_z_loss_backprop(gen, device, chunk_rows, backend, reduction):
    """(loss + 3 * z_loss).backward() matches the reference: gradients flow through z_loss too."""
    tuned = chunk_rows(3, 97)
    case = make_case(gen, (2, 9), 19, 97, device=device, bias=True)
    check_parity(
        case,
        gen,
        tol=FP32,
        z_weight=3.0,
        backend=backend,
        reduction=reduction,
        z_loss_scale=3e-2,
        return_z_loss=True,
        **tuned,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_z_loss_backprop_only_through_z(gen, device, backend):
    """Backward through z_loss alone (loss unused) gives the z-term gradients."""
    case = make_case(gen, (13,), 19, 97, device=device, bias=True)
    _, z = call_op(case, backend=backend, z_loss_scale=3e-2, return_z_loss=True)
    z.backward()
    _, ref_z, leaves = reference_for(case, z_loss_scale=3e-2)
    grads = torch.autograd.grad(ref_z, list(leaves.values()))
    for (name, t), rg in zip(case.tensors().items(), grads, strict=True):
        assert_close(f"grad {name}", t.grad, rg, FP32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_z_loss_zero_scale_returns_zero(gen, device, backend, reduction):
    case = make_case(gen, (2, 5), 19, 97, device=device, requires_grad=())
    loss, z = call_op(case, backend=backend, reduction=reduction, return_z_loss=True)
    assert (z == 0).all()
    ref, _, _ = reference_for(case, reduction=reduction)
    assert_close("loss", loss, ref, FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_return_z_loss_false_returns_tensor(gen, device, backend):
    case = make_case(gen, (5,), 19, 97, device=device, requires_grad=())
    out = call_op(case, backend=backend, z_loss_scale=1e-2)
    assert isinstance(out, torch.Tensor) and out.dim() == 0


# ---------------------------------------------------------------- gradient accumulation


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_accumulation_two_calls_two_backwards(gen, device, chunk_rows, backend):
    """Same leaves, two calls with different labels, backward after each, on top of an existing
    .grad: every .grad is initial + ref1 + ref2."""
    tuned = chunk_rows(3, 97)
    opts = dict(backend=backend, label_smoothing=0.1, z_loss_scale=1e-2, softcap=5.0)
    case1 = make_case(gen, (2, 9), 19, 97, device=device, bias=True)
    case2 = make_case(gen, (2, 9), 19, 97, device=device, bias=True)
    case2.hidden, case2.weight, case2.bias = case1.hidden, case1.weight, case1.bias  # new labels only
    initial = {}
    for name, t in case1.tensors().items():
        t.grad = torch.randn(t.shape, generator=gen).to(device, t.dtype)
        initial[name] = t.grad.detach().clone().double().cpu()

    expected = dict(initial)
    for case in (case1, case2):
        call_op(case, **opts, **tuned).backward()
        ref, _, leaves = reference_for(case, **opts)
        grads = torch.autograd.grad(ref, list(leaves.values()))
        for name, g in zip(leaves, grads, strict=True):
            expected[name] = expected[name] + g
    for name, t in case1.tensors().items():
        assert_close(f"accumulated grad {name}", t.grad, expected[name], FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_calls_one_backward(gen, device, backend):
    """Two calls on the same leaves summed into one loss before a single backward."""
    case1 = make_case(gen, (11,), 19, 97, device=device, bias=True)
    case2 = make_case(gen, (11,), 19, 97, device=device, bias=True)
    case2.hidden, case2.weight, case2.bias = case1.hidden, case1.weight, case1.bias
    (call_op(case1, backend=backend) + 2.0 * call_op(case2, backend=backend, reduction="sum")).backward()
    r1, _, l1 = reference_for(case1)
    r2, _, l2 = reference_for(case2, reduction="sum")
    g1 = torch.autograd.grad(r1, list(l1.values()))
    g2 = torch.autograd.grad(r2, list(l2.values()))
    for (name, t), a, b in zip(case1.tensors().items(), g1, g2, strict=True):
        assert_close(f"grad {name}", t.grad, a + 2.0 * b, FP32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_micro_batches_with_num_items_equal_full_batch(gen, device, chunk_rows, backend):
    """Gradient accumulation as HF does it: two micro-batches, each divided by the total number
    of kept tokens, accumulate to the full-batch mean loss and gradients."""
    tuned = chunk_rows(3, 97)
    full = make_case(gen, (2, 13), 19, 97, device=device, bias=True, ignore="half")
    total = torch.tensor(full.n_kept, device=device)
    parts = []
    for rows in (slice(0, 1), slice(1, 2)):
        h = full.hidden.detach()[rows].clone().requires_grad_()
        parts.append((h, full.labels[rows]))
    w, b = full.weight, full.bias
    loss_sum = 0.0
    for h, y in parts:
        loss = call_raw(h, w, y, b, backend=backend, num_items_in_batch=total, label_smoothing=0.1, **tuned)
        loss.backward()
        loss_sum += loss.detach().double().cpu()
    ref, _, leaves = reference_for(full, label_smoothing=0.1)
    assert_close("sum of micro-batch losses", loss_sum, ref, FP32)
    grads = dict(zip(leaves, torch.autograd.grad(ref, list(leaves.values())), strict=True))
    assert_close("grad weight", w.grad, grads["weight"], FP32)
    assert_close("grad bias", b.grad, grads["bias"], FP32)
    assert_close("grad hidden", torch.cat([parts[0][0].grad, parts[1][0].grad]), grads["hidden"], FP32)


# ---------------------------------------------------------------- layouts, mutation, autocast


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(gen, device, chunk_rows, backend):
    """Shifted views as a causal LM makes them (hidden[:, :-1], labels[:, 1:]), a transposed
    weight and a strided bias."""
    tuned = chunk_rows(3, 97)
    H, V = 19, 97
    h_base = torch.randn(2, 10, H, generator=gen).to(device).requires_grad_()
    wt_base = (torch.randn(H, V, generator=gen) * 0.5).to(device).requires_grad_()
    b_base = torch.randn(2 * V, generator=gen).to(device).requires_grad_()
    y_base = torch.randint(0, V, (2, 10), generator=gen)
    y_base[0, :3] = -100
    y_base = y_base.to(device)
    hidden, weight, bias, labels = h_base[:, :-1], wt_base.T, b_base[::2], y_base[:, 1:]
    assert not (hidden.is_contiguous() or weight.is_contiguous() or labels.is_contiguous())

    loss = call_raw(hidden, weight, labels, bias, backend=backend, reduction="none", **tuned)
    g = torch.randn(loss.shape, generator=gen).to(device)
    (loss * g).sum().backward()

    hr = hidden.detach().cpu().double().requires_grad_()
    wr = weight.detach().cpu().double().requires_grad_()
    br = bias.detach().cpu().double().requires_grad_()
    ref, _ = reference_flce(hr, wr, labels.cpu(), br, reduction="none")
    assert_close("loss", loss, ref, FP32)
    (ref * g.cpu().double()).sum().backward()
    assert_close("grad hidden", h_base.grad[:, :-1], hr.grad, FP32)
    assert (h_base.grad[:, -1] == 0).all()
    assert_close("grad weight", wt_base.grad.T, wr.grad, FP32)
    assert_close("grad bias", b_base.grad[::2], br.grad, FP32)
    assert (b_base.grad[1::2] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_are_not_modified(gen, device, chunk_rows, backend):
    tuned = chunk_rows(3, 97)
    case = make_case(gen, (2, 9), 19, 97, device=device, bias=True)
    before = {k: t.detach().clone() for k, t in case.tensors().items()}
    labels_before = case.labels.clone()
    loss, z = call_op(
        case, backend=backend, label_smoothing=0.1, z_loss_scale=1e-2, return_z_loss=True, **tuned
    )
    (loss + z).backward()
    for name, t in case.tensors().items():
        assert torch.equal(t.detach(), before[name]), f"{name} was modified in place"
    assert torch.equal(case.labels, labels_before), "labels were modified in place"


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32_inputs", "bf16_hidden_fp32_weight"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_casts_like_linear(gen, device, backend, mixed):
    """Under autocast(bf16) inputs are cast to bf16 like nn.Linear; grads come back in each
    input's own dtype."""
    case = make_case(gen, (2, 7), 19, 97, device=device, bias=True)
    if mixed:
        case.hidden = case.hidden.detach().to(torch.bfloat16).requires_grad_()
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = call_op(case, backend=backend, label_smoothing=0.1)
    loss.backward()
    rounded = Case(
        hidden=case.hidden.detach().to(torch.bfloat16).requires_grad_(),
        weight=case.weight.detach().to(torch.bfloat16).requires_grad_(),
        labels=case.labels,
        bias=case.bias.detach().to(torch.bfloat16).requires_grad_(),
        ignore_index=case.ignore_index,
    )
    ref, _, leaves = reference_for(rounded, label_smoothing=0.1)
    tol = TOL[torch.bfloat16]
    assert_close("loss", loss, ref, tol)
    grads = torch.autograd.grad(ref, list(leaves.values()))
    for (name, t), rg in zip(case.tensors().items(), grads, strict=True):
        assert t.grad is not None and t.grad.dtype == t.dtype, (
            f"{name}.grad dtype {t.grad.dtype} != {t.dtype}"
        )
        assert_close(f"grad {name}", t.grad, rg, tol)


@pytest.mark.parametrize("grads", ["all", "hidden_only", "second_backward", "create_graph"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_rounds_the_weight_like_linear(gen, device, chunk_rows, backend, grads):
    """The fp32 weight reaches the op uncast (its GEMM copy is made inside, in grad_W's bytes on a
    GPU), yet the GEMMs must see it rounded to bf16 as ``nn.Linear`` under autocast does. With
    fp32 logits the only rounding left is the operands', so the fp64 reference on bf16-rounded
    inputs must agree to fp32 accuracy (an unrounded weight is off by ~1e-3); also when only
    hidden wants a gradient (no grad_W to hold the copy), and in a second backward over a
    retained graph (the recompute path, which reads the saved fp32 weight) and with
    ``create_graph=True`` (the dense differentiable path)."""
    H, V = 16, 97  # V*H*4 bytes a multiple of 16: the copy fits grad_W's second half on a GPU
    hidden = torch.randn(3, 11, H, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.5).to(device).requires_grad_(grads != "hidden_only")
    labels = torch.randint(0, V, (3, 11), generator=gen).to(device)
    labels[0, :4] = -100
    opts = dict(backend=backend, logits_dtype=torch.float32, z_loss_scale=1e-2, **chunk_rows(8, V))
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = call_raw(hidden, weight, labels, reduction="none", **opts)  # per row: the sharpest check
    up = torch.randn(loss.shape, generator=gen).to(device)
    leaves = [hidden] + ([weight] if weight.requires_grad else [])
    got = torch.autograd.grad(
        loss, leaves, up, retain_graph=grads == "second_backward", create_graph=grads == "create_graph"
    )
    if grads == "second_backward":
        got = torch.autograd.grad(loss, leaves, up)

    hr = hidden.detach().cpu().bfloat16().double().requires_grad_()
    wr = weight.detach().cpu().bfloat16().double().requires_grad_()
    ref, _ = reference_flce(hr, wr, labels.cpu(), z_loss_scale=1e-2, reduction="none")
    assert_close("loss", loss, ref, FP32)
    want = torch.autograd.grad(ref, [hr, wr][: len(leaves)], up.cpu().double())
    for name, g, w in zip(["grad hidden", "grad weight"], got, want, strict=False):
        assert g.dtype == torch.float32
        # grad_h and grad_W are rounded to bf16 once (the GEMMs' dtype), as under nn.Linear
        assert_close(name, g, w, TOL[torch.bfloat16])
