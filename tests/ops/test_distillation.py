"""``fused_linear_distillation`` against an fp64 dense reference (values and the student's
gradients), which is itself checked against TRL's own ``generalized_jsd_loss``.

Sizes are odd and chunks are forced small through ``memory_budget`` (``_budget_for``), so every
case runs several chunks and a remainder; ignored tokens make the chunks walk a kept-row index.
Bad input is tests/ops/test_distillation_errors.py's.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from op_helpers import IGNORE_PATTERNS, TOL, assert_close, examples, ignore_mask
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import liger_patch as lp
from liger_patch.ops import distillation_chunks
from liger_patch.ops.budget import PER_TOKEN_BYTES, SLACK_BYTES
from liger_patch.ops.distillation_options import build_distill_options
from liger_patch.ops.distillation_rows import ROW_BUFFERS

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

LEAD, HS, HT, V = (2, 7), 9, 12, 37
BETAS = [0.0, 0.3, 0.5, 1.0]
FP32 = TOL[torch.float32]
STUDENT = ("student_hidden", "student_weight", "student_bias")


# ---------------------------------------------------------------- the reference


def _final(hidden, weight, bias, scale, cap):
    """softcap(s * (W h + b)) in fp64, (tokens, V)."""
    x = hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().T
    if bias is not None:
        x = x + bias.double()
    if scale is not None:
        x = x * scale
    return x if cap is None else cap * torch.tanh(x / cap)


def reference_distill(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    labels,
    student_bias=None,
    teacher_bias=None,
    *,
    beta=0.0,
    temperature=1.0,
    ce_weight=0.0,
    ignore_index=-100,
    reduction="mean",
    num_items_in_batch=None,
    student_softcap=None,
    teacher_softcap=None,
    student_logit_scale=None,
    teacher_logit_scale=None,
):
    """The loss in fp64 with the full logits, from the math (docs/distillation.md):
    differentiable with respect to whatever requires grad."""
    zs = _final(student_hidden, student_weight, student_bias, student_logit_scale, student_softcap)
    zt = _final(teacher_hidden, teacher_weight, teacher_bias, teacher_logit_scale, teacher_softcap)
    log_ps = F.log_softmax(zs / temperature, dim=-1)
    log_pt = F.log_softmax(zt / temperature, dim=-1)
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0:
        div = (pt * (log_pt - log_ps)).sum(-1)
    elif beta == 1:
        div = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = ((1 - beta) * ps + beta * pt).log()
        div = beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)
    y = labels.reshape(-1)
    keep = y != ignore_index
    ce = torch.logsumexp(zs, -1) - zs.gather(-1, torch.where(keep, y, 0)[:, None]).squeeze(-1)
    rows = torch.where(keep, (1 - ce_weight) * div + ce_weight * ce, 0.0)
    if reduction == "none":
        return rows.reshape(labels.shape)
    if reduction == "sum":
        return rows.sum()
    divisor = keep.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch)
    return rows.sum() / (divisor.double() if float(divisor) != 0 else 1.0)


def _trl_generalized_jsd():
    """TRL's own ``GKDTrainer.generalized_jsd_loss``, its source run without importing the trainer
    stack (which takes ~11 s): the function needs only torch and F."""
    spec = importlib.util.find_spec("trl")
    path = None if spec is None else Path(spec.origin).parent / "experimental" / "gkd" / "gkd_trainer.py"
    if path is None or not path.exists():
        pytest.skip("trl (with experimental/gkd) is not installed")
    tree = ast.parse(path.read_text())
    found = [
        node
        for cls in tree.body
        if isinstance(cls, ast.ClassDef) and cls.name == "GKDTrainer"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name == "generalized_jsd_loss"
    ]
    if not found:
        pytest.skip("this trl has no GKDTrainer.generalized_jsd_loss")
    found[0].decorator_list = []
    namespace = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=found, type_ignores=[]), str(path), "exec"), namespace)
    return namespace["generalized_jsd_loss"]


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("beta", BETAS)
def test_reference_is_trls_generalized_jsd(gen, beta, temperature):
    trl_loss = _trl_generalized_jsd()
    zs = (torch.randn(*LEAD, V, generator=gen) * 2).double().requires_grad_()
    zt = (torch.randn(*LEAD, V, generator=gen) * 2).double()
    labels = torch.randint(0, V, LEAD, generator=gen)
    labels[0, :3] = -100
    eye = torch.eye(V, dtype=torch.float64)
    ours = reference_distill(zs, eye, zt, eye, labels, beta=beta, temperature=temperature)
    theirs = trl_loss(zs, zt, labels, beta=beta, temperature=temperature, reduction="batchmean")
    assert_close("loss", ours, theirs, 1e-12)
    (g_ours,) = torch.autograd.grad(ours, zs)
    (g_theirs,) = torch.autograd.grad(theirs, zs)
    assert_close("grad", g_ours, g_theirs, 1e-12)


# ---------------------------------------------------------------- cases and checks


def _case(
    gen, lead=LEAD, hs=HS, ht=HT, vocab=V, *, dtype=torch.float32, bias=True, ignore="mixed", spread=2.5
):
    """Student and teacher tensors (the student's require grad), labels with ``ignore`` tokens."""
    n = math.prod(lead)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[ignore_mask(ignore, n, gen)] = -100
    return dict(
        student_hidden=rand(*lead, hs).requires_grad_(),
        student_weight=rand(vocab, hs, scale=spread / math.sqrt(hs)).requires_grad_(),
        teacher_hidden=rand(*lead, ht),
        teacher_weight=rand(vocab, ht, scale=spread / math.sqrt(ht)),
        labels=labels.reshape(lead),
        student_bias=rand(vocab, scale=0.5).requires_grad_() if bias else None,
        teacher_bias=rand(vocab, scale=0.5) if bias else None,
    )


def _with_dtype(case: dict, dtype: torch.dtype) -> dict:
    """Copies of the case's float tensors in ``dtype`` (new leaves, requiring grad as before)."""
    return {
        k: v.detach().to(dtype).requires_grad_(v.requires_grad)
        if v is not None and v.is_floating_point()
        else v
        for k, v in case.items()
    }


def _budget_for(rows: int, case: dict) -> int:
    """The memory budget whose working bytes give chunks of exactly ``rows`` tokens."""
    n, vocab = case["labels"].numel(), case["student_weight"].shape[0]
    width = ROW_BUFFERS * vocab + 2 * case["student_hidden"].shape[-1] + case["teacher_hidden"].shape[-1]
    return SLACK_BYTES + PER_TOKEN_BYTES * n + rows * 4 * width


def _loss_and_grads(fn, case, upstream, **opts):
    """``fn``'s loss and the student's gradients of ``sum(loss * upstream)``."""
    leaves = {k: case[k] for k in STUDENT if case[k] is not None and case[k].requires_grad}
    loss = fn(**case, **opts)
    grads = torch.autograd.grad((loss * upstream).sum(), list(leaves.values()))
    return loss, dict(zip(leaves, grads, strict=True))


def _rounding_floors(case: dict, upstream: torch.Tensor, opts: dict) -> dict[str, torch.Tensor]:
    """What fp32 rounding of the logits alone may change, as absolute errors per element (fp64).

    A final logit a = z / T is computed to about eps |a|, which moves each log-prob of its row by
    up to eps max_v |a|: the token's loss by that much, and d loss / d x_v by that times
    (p_s + p_t + p_ce)_v and the chain's scale. Negligible unless the divergence or its gradient
    is formed by cancellation (a student close to its teacher), where fp32 cannot do better."""
    with torch.no_grad():
        t = opts.get("temperature", 1.0)
        s = abs(opts.get("student_logit_scale") or 1.0)
        zs, zt = (
            _final(
                *(case[f"{side}_{k}"] for k in ("hidden", "weight", "bias")),
                opts.get(f"{side}_logit_scale"),
                opts.get(f"{side}_softcap"),
            )
            for side in ("student", "teacher")
        )
        hidden = case["student_hidden"].reshape(zs.shape[0], case["student_hidden"].shape[-1]).double()
        keep = (case["labels"].reshape(-1) != opts.get("ignore_index", -100)).double()
        divisor = opts.get("num_items_in_batch") or keep.sum().clamp(min=1)
        row_weight = keep / float(divisor) if opts.get("reduction", "mean") == "mean" else keep
        row_err = 8 * torch.finfo(torch.float32).eps * (1 + (zs / t).abs().amax(-1) + (zt / t).abs().amax(-1))
        p = (zs / t).softmax(-1) + (zt / t).softmax(-1) + zs.softmax(-1)
        coef = row_weight * row_err * upstream.double().expand(case["labels"].shape).reshape(-1).abs()
        per_logit = coef[:, None] * p * max(s / t, s)
        loss = row_weight * row_err
        floors = {
            "loss": loss.reshape(case["labels"].shape) if opts.get("reduction") == "none" else loss.sum(),
            "student_hidden": (per_logit @ case["student_weight"].double().abs()).reshape(
                case["student_hidden"].shape
            ),
            "student_weight": per_logit.T @ hidden.abs(),
            "student_bias": per_logit.sum(0),
        }
    return floors


def _assert_near(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float, floor) -> None:
    """|actual - expected| <= tol (|expected| + max |expected|) + floor, elementwise."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    bound = tol * (e.abs() + (e.abs().max() if e.numel() else 0.0)) + floor
    worst = (a - e).abs() - bound
    assert not (worst > 0).any(), (
        f"{name}: {int((worst > 0).sum())}/{e.numel()} elements off; worst by {float(worst.max()):.3g} "
        f"(max |expected| {float(e.abs().max()):.4g})"
    )


def _check(case, gen, *, tol=FP32, rows=4, upstream=None, **opts):
    """The op (chunks of ``rows`` tokens) against the reference: loss and the student's gradients
    under ``upstream``, else a random upstream gradient (per token for "none")."""
    ref_case = _with_dtype(case, torch.float64)
    ref_loss = reference_distill(**ref_case, **opts)
    if upstream is None:
        upstream = torch.rand(ref_loss.shape, generator=gen, dtype=torch.float64) + 0.5
    upstream = torch.as_tensor(upstream, dtype=torch.float64)
    ref, ref_grads = _loss_and_grads(reference_distill, ref_case, upstream, **opts)
    floors = _rounding_floors(ref_case, upstream, opts)
    budget = _budget_for(rows, case)
    loss, grads = _loss_and_grads(
        lp.fused_linear_distillation, case, upstream.float(), memory_budget=budget, **opts
    )
    assert loss.dtype == torch.float32
    _assert_near("loss", loss, ref, tol, floors["loss"])
    for name, g in grads.items():
        assert g.dtype == case[name].dtype, name
        _assert_near(f"grad {name}", g, ref_grads[name], tol, floors[name])
    return loss, grads


OPTION_SETS = {
    "plain": dict(),
    "temperature_ce": dict(temperature=2.0, ce_weight=0.3),
    "caps_scales": dict(
        student_softcap=3.0, teacher_softcap=5.0, student_logit_scale=1.4, teacher_logit_scale=0.6
    ),
    "everything": dict(temperature=0.7, ce_weight=0.6, student_softcap=4.0, teacher_logit_scale=-1.3),
}


@pytest.mark.parametrize("options", list(OPTION_SETS), ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", BETAS)
def test_matches_reference(gen, beta, reduction, options):
    _check(_case(gen), gen, beta=beta, reduction=reduction, **OPTION_SETS[options])


@examples(0.1)
@given(
    beta=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
    temperature=st.floats(0.3, 4.0),
    ce_weight=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    caps=st.tuples(st.none() | st.floats(1.0, 8.0), st.none() | st.floats(1.0, 8.0)),
    scales=st.tuples(st.none() | st.floats(0.3, 2.0), st.none() | st.floats(-2.0, -0.3)),
    sizes=st.tuples(st.integers(1, 11), st.integers(1, 8), st.integers(1, 8), st.integers(2, 41)),
    rows=st.integers(1, 5),
    ignore=st.sampled_from(IGNORE_PATTERNS),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_drawn(
    beta, temperature, ce_weight, caps, scales, sizes, rows, ignore, reduction, seed
):
    gen = torch.Generator().manual_seed(seed)
    n, hs, ht, vocab = sizes
    case = _case(gen, (n,), hs, ht, vocab, bias=bool(seed % 2), ignore=ignore)
    opts = dict(
        beta=beta,
        temperature=temperature,
        ce_weight=ce_weight,
        student_softcap=caps[0],
        teacher_softcap=caps[1],
        student_logit_scale=scales[0],
        teacher_logit_scale=scales[1],
        reduction=reduction,
    )
    _check(case, gen, rows=rows, **opts)


# ---------------------------------------------------------------- tokens that count


@pytest.mark.parametrize("ignore", [*IGNORE_PATTERNS, "mixed"])
def test_ignored_tokens_anywhere(gen, ignore):
    _check(_case(gen, ignore=ignore), gen, beta=0.5, ce_weight=0.2, reduction="mean")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_ignored_is_exactly_zero(gen, beta, reduction):
    case = _case(gen, ignore="all")
    loss = lp.fused_linear_distillation(**case, beta=beta, reduction=reduction, ce_weight=0.5)
    assert torch.equal(loss, torch.zeros_like(loss)) and loss.requires_grad
    loss.sum().backward()
    for name in STUDENT:
        assert torch.equal(case[name].grad, torch.zeros_like(case[name])), name


def test_no_tokens(gen):
    case = _case(gen, lead=(0,))
    loss = lp.fused_linear_distillation(**case, beta=0.5)
    assert loss.item() == 0.0
    loss.backward()
    assert case["student_weight"].grad.abs().sum() == 0


@pytest.mark.parametrize("num_items", [5, 23.5, "int_tensor", "float_tensor"])
def test_num_items_in_batch(gen, num_items):
    value = {"int_tensor": torch.tensor(17), "float_tensor": torch.tensor(9.5)}.get(num_items, num_items)
    _check(_case(gen), gen, beta=0.3, num_items_in_batch=value)


def test_num_items_zero_with_nothing_kept(gen):
    case = _case(gen, ignore="all")
    loss = lp.fused_linear_distillation(**case, num_items_in_batch=0)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(case["student_hidden"].grad).all()


# ---------------------------------------------------------------- dtypes and layouts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision(gen, dtype, reduction):
    """fp16 takes the recompute path for every reduction; bf16 precomputes with "mean"."""
    _check(_case(gen, dtype=dtype), gen, tol=TOL[dtype], beta=0.5, ce_weight=0.2, reduction=reduction)


def test_half_inputs_round_once_on_the_cpu(gen):
    """On the CPU the GEMMs and sums run in fp32: bf16 inputs give the fp32 op's loss on the same
    (rounded) values and its gradients rounded once to bf16 (grad_W summed over chunks in fp32)."""
    case = _case(gen, lead=(40,), dtype=torch.bfloat16)
    wide = _with_dtype(case, torch.float32)
    opts = dict(beta=0.3, reduction="sum", memory_budget=_budget_for(3, case))
    half, half_grads = _loss_and_grads(lp.fused_linear_distillation, case, torch.tensor(1.0), **opts)
    full, full_grads = _loss_and_grads(lp.fused_linear_distillation, wide, torch.tensor(1.0), **opts)
    assert torch.equal(half, full)
    for name, g in half_grads.items():
        assert torch.equal(g, full_grads[name].bfloat16()), name


def test_fp16_gradients_under_a_loss_scale(gen):
    """fp16 gradients are computed with the upstream gradient (a GradScaler's 2^16) already in:
    computed at scale 1 and rounded to fp16 first, these small ones would flush to zero."""
    case = _case(gen, dtype=torch.float16)
    _check(case, gen, tol=TOL[torch.float16], beta=0.5, num_items_in_batch=3e5, upstream=65536.0)


def test_autocast(gen):
    """Under CPU autocast the fp32 tensors are used as bf16, as nn.Linear would use them; the
    gradients come back in fp32."""
    case = _case(gen)
    rounded = _with_dtype(_with_dtype(case, torch.bfloat16), torch.float32)
    up = torch.tensor(1.3)
    ref, ref_grads = _loss_and_grads(reference_distill, rounded, up, beta=0.3, temperature=1.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(lp.fused_linear_distillation, case, up, beta=0.3, temperature=1.5)
    tol = TOL[torch.bfloat16]
    assert_close("loss", loss, ref, tol)
    for name, g in grads.items():
        assert g.dtype == torch.float32
        assert_close(f"grad {name}", g, ref_grads[name], tol)


def test_strided_inputs(gen):
    """A transposed student weight and hidden states, an expanded (stride 0) teacher input, a
    sliced teacher weight and strided labels give what contiguous copies give."""
    n = math.prod(LEAD)
    student_hidden = torch.randn(HS, n, generator=gen).t().reshape(*LEAD, HS).requires_grad_()
    assert not student_hidden.is_contiguous() or student_hidden.reshape(-1).numel() == 0
    student_weight = (torch.randn(HS, V, generator=gen) * 0.7).t().requires_grad_()
    teacher_hidden = torch.randn(1, LEAD[1], HT, generator=gen).expand(LEAD[0], LEAD[1], HT)
    teacher_weight = (torch.randn(V, 2 * HT, generator=gen) * 0.5)[:, ::2]
    labels = torch.randint(0, V, (LEAD[0], 2 * LEAD[1]), generator=gen)[:, ::2]
    labels[0, 1] = -100
    case = dict(
        student_hidden=student_hidden,
        student_weight=student_weight,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        labels=labels,
        student_bias=torch.randn(2 * V, generator=gen)[::2].requires_grad_(),
        teacher_bias=None,
    )
    assert not student_weight.is_contiguous() and teacher_hidden.stride(0) == 0
    _check(case, gen, beta=0.3, reduction="none", student_softcap=5.0)


def test_very_different_hidden_sizes(gen):
    _check(_case(gen, hs=3, ht=40), gen, beta=0.5, ce_weight=0.5)


# ---------------------------------------------------------------- the teacher


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_teacher_requiring_grad_gets_none(gen, reduction):
    case = _case(gen)
    for name in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        case[name].requires_grad_()
    _check(case, gen, beta=0.5, reduction=reduction)
    loss = lp.fused_linear_distillation(**case, beta=0.5, reduction=reduction)
    loss.sum().backward()
    assert all(case[k].grad is None for k in ("teacher_hidden", "teacher_weight", "teacher_bias"))
    assert case["student_weight"].grad is not None
    frozen = {k: v.detach() if k.startswith("student") and v is not None else v for k, v in case.items()}
    lp.fused_linear_distillation(**frozen, beta=0.5, reduction=reduction).sum().backward()  # nothing to do
    assert all(case[k].grad is None for k in ("teacher_hidden", "teacher_weight", "teacher_bias"))


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_teacher_inference_tensors(gen, reduction):
    """Teacher tensors made under torch.inference_mode (TRL runs the teacher under no_grad or
    inference mode) work on both backward paths (precomputed "sum", recomputed "none")."""
    case = _case(gen)
    with torch.inference_mode():
        teacher = {k: case[k].clone() for k in ("teacher_hidden", "teacher_weight", "teacher_bias")}
    assert teacher["teacher_weight"].is_inference()
    case.update(teacher)
    _check(case, gen, beta=0.3, reduction=reduction)


def test_whole_call_under_inference_mode(gen):
    case = _case(gen)
    expected = lp.fused_linear_distillation(**case, beta=0.5).detach()
    with torch.inference_mode():
        loss = lp.fused_linear_distillation(**case, beta=0.5)
    assert torch.equal(loss, expected)


# ---------------------------------------------------------------- backward paths


def test_second_backward(gen):
    """A retained graph: reduction "none" recomputes every time (same gradients twice); "mean",
    whose forward computed the gradients, refuses a second backward by name."""
    case = _case(gen)
    loss = lp.fused_linear_distillation(**case, beta=0.5, reduction="none")
    first = torch.autograd.grad(loss.sum(), case["student_weight"], retain_graph=True)[0]
    second = torch.autograd.grad(loss.sum(), case["student_weight"])[0]
    assert torch.equal(first, second)
    loss = lp.fused_linear_distillation(**case, beta=0.5)
    torch.autograd.grad(loss, case["student_weight"], retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, case["student_weight"])


def test_create_graph_refused(gen):
    case = _case(gen)
    loss = lp.fused_linear_distillation(**case, beta=0.5)
    with pytest.raises(NotImplementedError, match="second derivative"):
        torch.autograd.grad(loss, case["student_hidden"], create_graph=True)


def test_only_some_student_inputs_require_grad(gen):
    case = _case(gen)
    case["student_hidden"].requires_grad_(False)
    case["student_bias"].requires_grad_(False)
    _check(case, gen, beta=0.3, temperature=2.0)


# ---------------------------------------------------------------- memory


class _LiveBytes(TorchDispatchMode):
    """The most bytes of tensors made by ops inside the mode that were alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if storage is None or storage.data_ptr() in self.sizes or storage.nbytes() == 0:
                continue
            ptr = storage.data_ptr()
            self.sizes[ptr] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.live -= self.sizes.pop(ptr, 0)


@pytest.mark.parametrize("softcaps", [False, True])
def test_working_memory_within_budget(gen, softcaps):
    """The chunk loop allocates, beyond its results (losses and gradients), no more than the
    working bytes of its budget, with chunks as large as they allow; with softcaps on both sides
    (the most buffers at once) it comes close, so ``ROW_BUFFERS`` is the true peak and not a
    loose bound. (Measured on ``run_distill``: a dispatch mode does not see inside the operator.)"""
    case = _case(gen, lead=(48,), hs=16, ht=24, vocab=3001, ignore="first")
    opts = dict(beta=0.5, ce_weight=0.5, temperature=2.0, teacher_logit_scale=1.3)
    if softcaps:
        opts.update(student_softcap=4.0, teacher_softcap=5.0)
    working = _budget_for(10, case) - SLACK_BYTES - PER_TOKEN_BYTES * 48
    student = distillation_chunks.Head(*(case[k].detach() for k in STUDENT))
    teacher = distillation_chunks.Head(case["teacher_hidden"], case["teacher_weight"], case["teacher_bias"])
    labels = case["labels"]
    kept = torch.nonzero(labels != -100).view(-1)
    with _LiveBytes() as mode:
        res = distillation_chunks.run_distill(
            student,
            teacher,
            labels,
            build_distill_options(**opts),
            kept=kept,
            coef=torch.full((48,), 0.1),
            needs=(True, True, True),
            budget_bytes=working,
        )
    results = [res.loss, res.grad_hidden, res.grad_weight, res.grad_bias]
    used = mode.peak - sum(t.numel() * t.element_size() for t in results)
    assert used <= working, (used, working)
    assert used > (0.9 if softcaps else 0.6) * working, (used, working)
    assert distillation_chunks.distill_chunk_rows(47, 3001, 16, 24, working) == 10


def test_chunks_as_budgeted(gen, monkeypatch):
    """``_budget_for(rows)`` (what every check here runs with) gives chunks of ``rows`` kept tokens."""
    seen = []
    real = distillation_chunks.distill_rows
    monkeypatch.setattr(
        distillation_chunks, "distill_rows", lambda ls, *a, **k: seen.append(len(ls)) or real(ls, *a, **k)
    )
    case = _case(gen, ignore="first")
    lp.fused_linear_distillation(**case, memory_budget=_budget_for(4, case)).backward()
    assert seen == [4, 4, 4, 1]  # 13 kept tokens, in the forward (the backward only scales)


# ---------------------------------------------------------------- entry points


def test_module_matches_functional(gen):
    case = _case(gen)
    module = lp.FusedLinearDistillationLoss(
        beta=0.3, temperature=2.0, reduction="sum", num_items_in_batch=None
    )
    assert "beta=0.3" in repr(module) and "temperature=2.0" in repr(module)
    expected = lp.fused_linear_distillation(**case, beta=0.3, temperature=2.0, reduction="sum")
    names = ("student_hidden", "student_weight", "teacher_hidden", "teacher_weight", "labels")
    got = module(*(case[k] for k in names), case["student_bias"], case["teacher_bias"])
    assert torch.equal(got, expected)
    mean = lp.FusedLinearDistillationLoss(num_items_in_batch=100)
    assert torch.allclose(mean(**case) * 100, lp.fused_linear_distillation(**case, reduction="sum"))
    assert torch.allclose(mean(**case, num_items_in_batch=10) * 10, mean(**case) * 100)


def test_exported():
    assert lp.fused_linear_distillation is not None and "fused_linear_distillation" in lp.__all__
    assert "FusedLinearDistillationLoss" in lp.__all__
    assert (
        "beta" in lp.fused_linear_distillation.__doc__
        and "<OPTIONS>" not in lp.fused_linear_distillation.__doc__
    )


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_matches_eager(gen, reduction):
    """torch.compile(fullgraph=True) of a call (dynamic shapes, the temperature from a variable)
    gives the eager loss and gradients, for another length and another temperature too."""
    case = _case(gen)

    def step(temperature, **tensors):
        options = dict(beta=0.3, ce_weight=0.1, student_softcap=6.0, reduction=reduction)
        loss = lp.fused_linear_distillation(**tensors, temperature=temperature, **options)
        return loss.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    calls = ((2.0, LEAD[1]), (2.0, LEAD[1] - 2), (0.5, LEAD[1])) if reduction == "mean" else ((2.0, LEAD[1]),)
    for temperature, length in calls:
        part = {
            k: v if v is None or k.endswith(("weight", "bias")) else v[:, :length] for k, v in case.items()
        }
        leaves = [case[k] for k in STUDENT]
        eager = step(temperature, **part)
        eager_grads = torch.autograd.grad(eager, leaves)
        got = compiled(temperature, **part)
        got_grads = torch.autograd.grad(got, leaves)
        assert_close("compiled loss", got, eager, 1e-6)
        for name, a, b in zip(STUDENT, got_grads, eager_grads, strict=True):
            assert_close(f"compiled grad {name}", a, b, 1e-6)


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_module(gen):
    case = _case(gen)
    module = lp.FusedLinearDistillationLoss(beta=1.0, temperature=1.5)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    assert_close("compiled module", compiled(**case), module(**case), 1e-6)
