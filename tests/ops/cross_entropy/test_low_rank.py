"""The op's low-rank term (liger_patch/ops/cross_entropy/low_rank.py): ``h W^T + u B^T`` against an fp64 dense
reference, which is the plain op of the concatenations ``[h, u] [W, B]^T`` (so it shares nothing
with the chunk code), for the values and the gradients of h, W, u and B."""

from __future__ import annotations

import pytest
import torch
from op_helpers import BACKENDS, TOL, assert_close, ignore_mask

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.functional import fused_loss
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.reference import reference_flce

N, H, V, R = 23, 13, 41, 3  # odd sizes: nothing divides anything


def _inputs(
    gen, dtype, *, ignore="runs", n=N, rank=R, layout="contiguous", bias=False, h=H, v=V, device="cpu"
):
    """hidden, weight, labels, bias, u, B on ``device`` (rounded to ``dtype``; u and B in the
    layout asked for), drawn on the CPU so that every device sees the same values."""
    hidden = torch.randn(n, h, generator=gen)
    weight = torch.randn(v, h, generator=gen) * 0.4
    u = torch.randn(n, rank, generator=gen)
    b = torch.randn(v, rank, generator=gen) * 0.5
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[ignore_mask(ignore, n, gen)] = -100
    b_vec = torch.randn(v, generator=gen) * 0.1 if bias else None
    hidden, weight, u, b = (t.to(device, dtype) for t in (hidden, weight, u, b))
    labels = labels.to(device)
    b_vec = None if b_vec is None else b_vec.to(device)
    if layout == "transposed":  # u and B as transposes of (r, N) and (r, V) tensors
        u, b = u.t().contiguous().t(), b.t().contiguous().t()
    elif layout == "strided":  # every other column of wider tensors
        u = torch.stack((u, u), -1).reshape(n, 2 * rank)[:, ::2]
        b = torch.stack((b, b), -1).reshape(v, 2 * rank)[:, ::2]
    return hidden, weight, labels, None if b_vec is None else b_vec.to(dtype), u, b


def _reference(hidden, weight, labels, bias, u, b, needs, **opts):
    """fp64 loss and the gradients of (hidden, weight, u, B) that ``needs`` asks for."""
    leaves = [
        t.detach().double().requires_grad_(need)
        for t, need in zip((hidden, weight, u, b), needs, strict=True)
    ]
    h64, w64, u64, b64 = leaves
    bias64 = None if bias is None else bias.double()
    loss, _ = reference_flce(torch.cat((h64, u64), -1), torch.cat((w64, b64), -1), labels, bias64, **opts)
    return loss, leaves


def _check(
    gen,
    dtype,
    backend,
    *,
    device="cpu",
    needs=(True, False, True, True),
    ignore="runs",
    layout="contiguous",
    rows=None,
    bias=False,
    two_pass=False,
    z_grad=False,
    **opts,
):
    hidden, weight, labels, bvec, u, b = _inputs(
        gen, dtype, ignore=ignore, layout=layout, bias=bias, device=device
    )
    tensors = [
        t.detach().clone().requires_grad_(need) if t.is_contiguous() else t.requires_grad_(need)
        for t, need in zip((hidden, weight, u, b), needs, strict=True)
    ]
    h, w, uu, bb = tensors
    forced = rows or (1 << 30)
    tuning = Tuning(chunk_rows=forced, min_token_chunk_rows=forced + 1 if two_pass else 0)
    options = LossOptions.from_kwargs(backend=backend, tuning=tuning, memory_budget=4 * V * forced, **opts)
    out = fused_loss(h, w, labels, bvec, options=options, low_rank=(uu, bb))
    loss, z = (out.loss, out.z_loss) if isinstance(out, tuple) else (out, None)
    ref_opts = {k: v for k, v in opts.items() if k != "return_z_loss"}
    ref_loss, leaves = _reference(hidden, weight, labels, bvec, u, b, needs, **ref_opts)
    tol = TOL[dtype]
    assert_close("loss", loss, ref_loss, tol)
    up = torch.randn(ref_loss.shape, generator=gen, dtype=torch.float64).to(device) if ref_loss.dim() else 1.3
    obj = (loss * (up.to(loss.dtype) if torch.is_tensor(up) else up)).sum()
    if z_grad:  # a gradient through z_loss: the recompute backward even for "mean"
        obj = obj + 0.0 * z
    obj.backward()
    ref_grads = torch.autograd.grad(
        (ref_loss * up).sum(), [t for t, n in zip(leaves, needs, strict=True) if n]
    )
    got = [t.grad for t, n in zip(tensors, needs, strict=True) if n]
    names = [name for name, n in zip(("hidden", "weight", "u", "B"), needs, strict=True) if n]
    for name, g, rg in zip(names, got, ref_grads, strict=True):
        assert g is not None and g.dtype == dtype, f"grad {name}: {None if g is None else g.dtype}"
        assert_close(f"grad {name}", g, rg, tol)
    return loss


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_values_and_grads_against_fp64(gen, device, backend, dtype, reduction):
    """Forward-precomputed ("mean", "sum") and recomputed ("none") gradients, in several chunks."""
    _check(gen, dtype, backend, device=device, rows=5, reduction=reduction)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ignore", ["none", "first", "last", "all_but_one", "only_first_kept", "half", "all"])
def test_ignored_rows_in_every_position(gen, device, backend, ignore):
    """Many ignored rows: the forward walks the kept rows only (u's rows gathered too)."""
    _check(gen, torch.float32, backend, device=device, rows=4, ignore=ignore, needs=(True, True, True, True))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["transposed", "strided"])
def test_strided_and_transposed_u_and_b(gen, device, backend, layout):
    _check(gen, torch.float32, backend, device=device, rows=6, layout=layout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_backward_with_bias_and_z_loss(gen, device, backend):
    """A gradient through the z-loss sends "mean" through ``flce_backward``: the term is recomputed."""
    _check(
        gen,
        torch.float32,
        backend,
        device=device,
        rows=7,
        bias=True,
        needs=(True, True, True, True),
        z_loss_scale=1e-2,
        return_z_loss=True,
        z_grad=True,
        softcap=5.0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_path(gen, device, backend):
    """The base weight wants a gradient and the budget is small: pass B recomputes the term too."""
    _check(gen, torch.float32, backend, device=device, rows=4, two_pass=True, needs=(True, True, True, True))


@pytest.mark.parametrize(
    "needs", [(False, False, True, False), (False, False, False, True), (True, False, False, False)]
)
def test_only_some_inputs_want_gradients(gen, needs):
    _check(gen, torch.float32, "torch", rows=5, needs=needs)


def test_the_term_changes_the_loss(gen):
    """Without the term the loss differs (the comparison above would see a dropped term)."""
    hidden, weight, labels, _, u, b = _inputs(gen, torch.float32)
    options = LossOptions.from_kwargs(backend="torch")
    with_term = fused_loss(hidden, weight, labels, options=options, low_rank=(u, b))
    without = fused_loss(hidden, weight, labels, options=options)
    assert (with_term - without).abs() > 1e-2


def test_bad_shapes_are_refused(gen):
    hidden, weight, labels, _, u, b = _inputs(gen, torch.float32)
    with pytest.raises(ValueError, match="low-rank term"):
        fused_loss(hidden, weight, labels, low_rank=(u[:-1], b))
    with pytest.raises(ValueError, match="low-rank term"):
        fused_loss(hidden, weight, labels, low_rank=(u, b[:, :-1]))


def test_compiled_fullgraph_matches_eager(gen):
    """``torch.compile(fullgraph=True)`` traces the op with the term (fake implementations)."""
    hidden, weight, labels, _, u, b = _inputs(gen, torch.float32)
    options = LossOptions.from_kwargs(backend="torch")

    def step(h, w, uu, bb):
        return fused_loss(h, w, labels, options=options, low_rank=(uu, bb))

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, u, b)]
        loss = fn(*leaves)
        loss.backward()
        results.append((loss.detach(), [t.grad for t in leaves]))
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager)
    for a, e in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, e)


def test_opcheck_with_the_term(gen):
    """Schema, fake implementations and autograd registration of both operators with (u, B)."""
    hidden, weight, labels, _, u, b = _inputs(gen, torch.float32, ignore="half")
    key = LossOptions.from_kwargs(backend="torch").key
    args = (hidden, weight, None, labels, None, None, None, key, [True, True, False, True, True])
    torch.library.opcheck(torch.ops.liger_patch.flce, args, {"low_rank_u": u, "low_rank_b": b})
    lse = torch.ops.liger_patch.flce(*args, low_rank_u=u, low_rank_b=b)[4]
    coef = torch.rand(N, generator=gen)
    back = (
        hidden,
        weight,
        None,
        labels,
        None,
        lse,
        coef,
        coef,
        None,
        None,
        key,
        [True, False, False, True, True],
    )
    torch.library.opcheck(torch.ops.liger_patch.flce_backward, back, {"low_rank_u": u, "low_rank_b": b})


def test_create_graph_backward_carries_the_term(gen):
    """``create_graph=True`` (the dense differentiable path): first gradients equal the fp64 ones
    and can be differentiated again."""
    hidden, weight, labels, _, u, b = _inputs(gen, torch.float32)
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, weight, u, b)]
    h, w, uu, bb = leaves
    loss = fused_loss(h, w, labels, options=LossOptions.from_kwargs(backend="torch"), low_rank=(uu, bb))
    grads = torch.autograd.grad(loss, leaves, create_graph=True)
    ref_loss, ref_leaves = _reference(hidden, weight, labels, None, u, b, (True,) * 4)
    ref_grads = torch.autograd.grad(ref_loss, ref_leaves)
    for name, g, rg in zip(("hidden", "weight", "u", "B"), grads, ref_grads, strict=True):
        assert_close(f"grad {name}", g, rg, TOL[torch.float32])
    assert grads[2].requires_grad and grads[3].requires_grad


def test_triton_fused_logits_gemm_is_not_used_with_the_term(gen, device, monkeypatch):
    """Sizes the Triton fused logits GEMM takes (16-byte aligned rows, and half inputs on CUDA):
    its log-sum-exp partials would miss the term, so the chunks go through cuBLAS and the term is
    added before the rows."""
    import dataclasses

    from liger_patch.ops.core.triton import logits as triton_logits
    from liger_patch.ops.cross_entropy import backends, operator

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # what the fused GEMM takes
    probe = [torch.zeros(rows, 16, device=device, dtype=dtype) for rows in (8, 48)]
    assert triton_logits.supported(*probe, dtype, Tuning())
    hidden, weight, labels, _, u, b = _inputs(gen, dtype, n=24, h=16, v=48, ignore="none", device=device)
    calls = []

    def spied(name, device):  # the Triton record with its fused GEMM counted (records are cached)
        backend = backends.row_backend(name, device)
        fused = backend.fused_logits
        counted = dataclasses.replace(
            fused, logits_with_partials=lambda *a, **k: calls.append(1) or fused.logits_with_partials(*a, **k)
        )
        return dataclasses.replace(backend, fused_logits=counted)

    monkeypatch.setattr(operator, "row_backend", spied)
    options = LossOptions.from_kwargs(backend="triton")
    leaves = [t.detach().clone().requires_grad_(True) for t in (hidden, u, b)]
    loss = fused_loss(leaves[0], weight, labels, options=options, low_rank=(leaves[1], leaves[2]))
    loss.backward()
    ref_loss, ref_leaves = _reference(hidden, weight, labels, None, u, b, (True, False, True, True))
    assert_close("loss", loss, ref_loss, TOL[dtype])
    ref_grads = torch.autograd.grad(ref_loss, [ref_leaves[0], ref_leaves[2], ref_leaves[3]])
    for name, t, rg in zip(("hidden", "u", "B"), leaves, ref_grads, strict=True):
        assert_close(f"grad {name}", t.grad, rg, TOL[dtype])
    assert not calls
    fused_loss(hidden, weight, labels, options=options)
    assert calls  # without the term these sizes do take the fused GEMM
