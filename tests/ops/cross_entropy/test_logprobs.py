"""lp.fused_linear_logprobs against dense fp64 math: log_softmax(softcap(s * x) / T) gathered at the
labels (TRL's ``selective_log_softmax(logits / T, ids)`` of a model whose forward already
softcapped its logits), and the entropy of that softmax; values and the gradients of hidden,
weight and bias through both (with random upstream gradients on each), on both backends.

The dense oracle here is written out in this file (F.linear, tanh, log_softmax,
torch.distributions.Categorical); liger_patch.ops.reference.reference_logprobs is checked
against it too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from op_helpers import BACKENDS, TOL, Case, assert_close, make_case, upstream_like

import liger_patch as lp
from liger_patch.ops.reference import reference_logprobs

FP32, BF16 = torch.float32, torch.bfloat16
H, V = 19, 97
TEMPERATURES = [1.0, 0.7, 1.3]
VARIANTS = {
    "plain": {},
    "softcap": {"softcap": 3.0},
    "logit_scale": {"logit_scale": 1.6},
    "softcap_and_scale": {"softcap": 5.0, "logit_scale": 0.6},
}


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def dense_logprobs(case: Case, temperature=1.0, softcap=None, logit_scale=None):
    """(logprobs, entropy, leaves): the dense fp64 oracle, 0 at ignored tokens."""
    leaves = {k: t.detach().cpu().double().requires_grad_(t.requires_grad) for k, t in case.tensors().items()}
    logits = F.linear(leaves["hidden"], leaves["weight"], leaves.get("bias"))
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)  # what a softcapping model's forward returns
    logits = logits / temperature  # then TRL: selective_log_softmax(logits / T, ids)
    labels = case.labels.cpu()
    keep = labels != case.ignore_index
    logp = (
        torch.log_softmax(logits, dim=-1).gather(-1, torch.where(keep, labels, 0).unsqueeze(-1)).squeeze(-1)
    )
    entropy = torch.distributions.Categorical(logits=logits).entropy()
    zero = logits.new_zeros(())
    return torch.where(keep, logp, zero), torch.where(keep, entropy, zero), leaves


def check_logprobs(case, gen, *, tol, return_entropy=True, **opts):
    math_opts = {k: opts[k] for k in ("temperature", "softcap", "logit_scale") if k in opts}
    out = lp.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.labels,
        case.bias,
        ignore_index=case.ignore_index,
        return_entropy=return_entropy,
        **opts,
    )
    ref_lp, ref_ent, leaves = dense_logprobs(case, **math_opts)
    lead = tuple(case.labels.shape)
    if return_entropy:
        assert (
            isinstance(out, tuple)
            and type(out).__name__ == "LogProbs"
            and out._fields == ("logprobs", "entropy")
        )
        logprobs, entropy = out
        assert entropy.dtype == torch.float32 and tuple(entropy.shape) == lead
        assert_close("entropy", entropy, ref_ent, tol)
    else:
        assert isinstance(out, torch.Tensor) and not isinstance(out, tuple)
        logprobs, entropy = out, None
    assert logprobs.dtype == torch.float32 and tuple(logprobs.shape) == lead
    assert_close("logprobs", logprobs, ref_lp, tol)
    ignored = (case.labels == case.ignore_index).to(logprobs.device)
    assert (logprobs[ignored] == 0).all(), "logprob must be 0 at ignored tokens"
    if entropy is not None:
        assert (entropy[ignored] == 0).all(), "entropy must be 0 at ignored tokens"
    assert (logprobs.detach()[~ignored] <= 0).all()

    grad_leaves = case.grad_leaves()
    if not grad_leaves or not logprobs.numel():
        return out, leaves
    g1 = upstream_like(ref_lp, gen)
    obj = (logprobs * g1.to(logprobs.device, logprobs.dtype)).sum()
    ref_obj = (ref_lp * g1).sum()
    if entropy is not None:
        g2 = upstream_like(ref_ent, gen)
        obj = obj + (entropy * g2.to(entropy.device, entropy.dtype)).sum()
        ref_obj = ref_obj + (ref_ent * g2).sum()
    obj.backward()
    ref_grads = torch.autograd.grad(ref_obj, [leaves[k] for k in grad_leaves])
    for (name, t), rg in zip(grad_leaves.items(), ref_grads, strict=True):
        assert t.grad is not None and t.grad.dtype == t.dtype, name
        assert_close(f"grad {name}", t.grad, rg, tol)
    return out, leaves


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_and_entropy_match_dense(gen, device, chunk_rows, backend, temperature, variant):
    """Several token chunks (26 tokens, chunks of 4), a bias, mixed ignored tokens."""
    case = make_case(gen, (2, 13), H, V, device=device, bias=True)
    check_logprobs(
        case,
        gen,
        tol=TOL[FP32],
        backend=backend,
        temperature=temperature,
        **VARIANTS[variant],
        **chunk_rows(4, V),
    )


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_alone_is_a_tensor(gen, device, backend, dtype):
    case = make_case(gen, (26,), H, V, dtype=dtype, device=device, bias=True)
    check_logprobs(
        case, gen, tol=TOL[dtype], return_entropy=False, backend=backend, temperature=0.7, softcap=4.0
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_bf16_with_entropy(gen, device, backend):
    case = make_case(gen, (26,), H, V, dtype=BF16, device=device, bias=True)
    check_logprobs(case, gen, tol=TOL[BF16], backend=backend, temperature=1.3, softcap=5.0, logit_scale=0.8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logprobs_two_pass(gen, device, chunk_rows, backend):
    case = make_case(gen, (31,), H, V, device=device, bias=True)
    check_logprobs(
        case,
        gen,
        tol=TOL[FP32],
        backend=backend,
        temperature=0.7,
        softcap=3.0,
        **chunk_rows(5, V, two_pass=True),
    )


@pytest.mark.parametrize("pattern", ["first_and_last", "runs", "only_last_kept", "all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_contribute_nothing(gen, device, chunk_rows, backend, pattern):
    """0 logprob and entropy at ignored tokens, no gradient to their hidden rows, and their hidden
    states do not change any other gradient."""
    case = make_case(gen, (26,), H, V, device=device, bias=True, ignore=pattern)
    tuned = chunk_rows(4, V)
    check_logprobs(case, gen, tol=TOL[FP32], backend=backend, temperature=0.7, **tuned)
    ignored = case.labels == case.ignore_index
    assert (case.hidden.grad[ignored] == 0).all(), "ignored tokens got a hidden gradient"
    if pattern == "all":
        for name, t in case.tensors().items():
            assert torch.isfinite(t.grad).all() and (t.grad == 0).all(), f"{name}.grad must be 0"
        return

    # Change the ignored tokens' hidden states: the outputs and every gradient stay the same.
    def run(hidden):
        hidden = hidden.detach().clone().requires_grad_()
        weight, bias = (t.detach().clone().requires_grad_() for t in (case.weight, case.bias))
        out = lp.fused_linear_logprobs(
            hidden, weight, case.labels, bias, temperature=0.7, return_entropy=True, backend=backend, **tuned
        )
        (out.logprobs * g1 + out.entropy * g2).sum().backward()
        return out, hidden.grad, weight.grad, bias.grad

    g1, g2 = (torch.randn(26, generator=gen).to(device) for _ in range(2))
    other = case.hidden.detach().clone()
    other[ignored] = torch.randn(int(ignored.sum()), H, generator=gen).to(device) * 5
    out1, *grads1 = run(case.hidden)
    out2, *grads2 = run(other)
    assert torch.equal(out1.logprobs, out2.logprobs) and torch.equal(out1.entropy, out2.entropy)
    for name, a, b in zip(("hidden", "weight", "bias"), grads1, grads2, strict=True):
        assert_close(f"grad {name} with other ignored hidden states", b, a, 1e-6)
    assert (grads2[0][ignored] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(gen, device, backend):
    case = make_case(gen, (0,), H, V, device=device, bias=True)
    out = lp.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.labels,
        case.bias,
        return_entropy=True,
        backend=backend,
        temperature=0.7,
    )
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    for name, t in case.tensors().items():
        assert t.grad is not None and (t.grad == 0).all(), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_temperature_one_is_minus_cross_entropy(gen, device, backend):
    """At T = 1 the log-probs are minus the per-token cross-entropy of the loss op."""
    case = make_case(gen, (3, 7), H, V, device=device, bias=True, requires_grad=())
    logprobs = lp.fused_linear_logprobs(
        case.hidden, case.weight, case.labels, case.bias, backend=backend, softcap=4.0
    )
    ce = lp.fused_linear_cross_entropy(
        case.hidden, case.weight, case.labels, case.bias, backend=backend, softcap=4.0, reduction="none"
    )
    assert torch.allclose(logprobs, -ce, rtol=1e-6, atol=1e-6)
    hot = lp.fused_linear_logprobs(
        case.hidden, case.weight, case.labels, case.bias, backend=backend, softcap=4.0, temperature=0.7
    )
    assert not torch.allclose(hot, logprobs, atol=1e-3), "temperature had no effect"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_reference_logprobs_matches_dense(gen, temperature, softcap):
    case = make_case(gen, (11,), 7, 13, bias=True)
    case.hidden = case.hidden.detach().double().requires_grad_()
    case.weight = case.weight.detach().double().requires_grad_()
    case.bias = case.bias.detach().double().requires_grad_()
    lp_ref, ent_ref = reference_logprobs(
        case.hidden,
        case.weight,
        case.labels,
        case.bias,
        temperature=temperature,
        softcap=softcap,
        logit_scale=1.3,
    )
    lp_dense, ent_dense, _ = dense_logprobs(case, temperature, softcap, 1.3)
    torch.testing.assert_close(lp_ref, lp_dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent_ref, ent_dense, rtol=1e-12, atol=1e-12)


BAD_TEMPERATURES = [0.0, -0.5, -1.0, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("temperature", BAD_TEMPERATURES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_temperature(gen, backend, temperature):
    case = make_case(gen, (4,), H, V)
    with pytest.raises(ValueError, match="temperature"):
        lp.fused_linear_logprobs(
            case.hidden, case.weight, case.labels, temperature=temperature, backend=backend
        )


def test_temperature_must_be_a_number(gen):
    case = make_case(gen, (4,), H, V)
    with pytest.raises(TypeError, match="temperature"):
        lp.fused_linear_logprobs(case.hidden, case.weight, case.labels, temperature="0.7")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"label_smoothing": 0.1},
        {"reduction": "sum"},
        {"z_loss_scale": 1e-4},
        {"return_z_loss": True},
        {"use_token_scaling": True},
        {"num_items_in_batch": 3},
        {"class_weight": None},
        {"temprature": 0.7},
    ],
    ids=str,
)
def test_unknown_keywords_are_refused(gen, kwargs):
    case = make_case(gen, (4,), H, V)
    with pytest.raises(TypeError):
        lp.fused_linear_logprobs(case.hidden, case.weight, case.labels, **kwargs)


def test_every_runtime_option_is_taken_and_listed():
    """The runtime options (tagged by kind in LossOptions) reach the log-prob op, each listed in
    its signature; a new one needs no edit here."""
    import inspect

    from liger_patch.ops.cross_entropy.options import OptionKind, options_of_kind

    runtime = options_of_kind(OptionKind.RUNTIME)
    assert set(runtime) <= set(inspect.signature(lp.fused_linear_logprobs).parameters)
    gen = torch.Generator().manual_seed(0)
    case = make_case(gen, (5,), H, V)
    plain = lp.fused_linear_logprobs(case.hidden, case.weight, case.labels, backend="torch")
    lean = lp.fused_linear_logprobs(
        case.hidden,
        case.weight,
        case.labels,
        backend="torch",
        memory_budget="lean",
        logits_dtype=torch.float32,
    )
    torch.testing.assert_close(lean, plain)
