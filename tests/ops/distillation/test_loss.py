"""``fused_linear_distillation`` against an fp64 dense reference (values and the student's
gradients), which is itself checked against TRL's own ``generalized_jsd_loss``, on both backends
(``backend``) and on ``device``: the Triton backend runs its kernels natively on CUDA tensors where
there is a GPU, and under the Triton interpreter on CPU tensors otherwise (tests/conftest.py sets
TRITON_INTERPRET=1 only without CUDA). Cases are drawn on the CPU from the seeded generator and
moved, so a test sees the same values on every device. The few tests about the CPU itself (CPU
arithmetic, allocations counted on the CPU, the torch backend's fp32 logits) run the torch
backend on CPU tensors, which works on any machine.

Sizes are odd and chunks are forced small through ``memory_budget`` (``budget_for``), so every
case runs several chunks and a remainder; ignored tokens make the chunks walk a kept-row index.
What only the Triton backend does (logits in the input dtype, its kernel's passes, the fused
GEMM's partials, larger shapes) is tests/ops/distillation/test_triton_chunk.py's; bad input is
tests/ops/distillation/test_errors.py's; the shared helpers are in distillation_cases.py.
"""

from __future__ import annotations

import ast
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from op_helpers import BACKENDS, IGNORE_PATTERNS, TOL, assert_close, examples

import liger_patch as lp
from liger_patch.ops.core.budget import PER_TOKEN_BYTES, SLACK_BYTES
from liger_patch.ops.core.options import constant_changes
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.distillation import chunks as distillation_chunks
from liger_patch.ops.distillation import triton_chunk as distillation_triton
from liger_patch.ops.distillation.options import DistillOptions, build_distill_options
from tests.ops.distillation.cases import (
    BETAS,
    HS,
    HT,
    LEAD,
    STUDENT,
    LiveBytes,
    V,
    budget_for,
    check,
    loss_and_grads,
    make_case,
    reference_distill,
    sides,
    with_dtype,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# Hypothesis tests cannot take function-scoped fixtures: the ``device`` fixture's device, by hand.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


# ---------------------------------------------------------------- the reference


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
def test_matches_reference(gen, backend, device, beta, reduction, options):
    case = make_case(gen, device=device)
    check(case, gen, backend=backend, beta=beta, reduction=reduction, **OPTION_SETS[options])


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
    backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_drawn(
    beta, temperature, ce_weight, caps, scales, sizes, rows, ignore, reduction, backend, seed
):
    gen = torch.Generator().manual_seed(seed)
    n, hs, ht, vocab = sizes
    case = make_case(gen, (n,), hs, ht, vocab, bias=bool(seed % 2), ignore=ignore, device=DEVICE)
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
    check(case, gen, backend=backend, rows=rows, **opts)


# ---------------------------------------------------------------- tokens that count


@pytest.mark.parametrize("ignore", [*IGNORE_PATTERNS, "mixed"])
def test_ignored_tokens_anywhere(gen, backend, device, ignore):
    case = make_case(gen, ignore=ignore, device=device)
    check(case, gen, backend=backend, beta=0.5, ce_weight=0.2, reduction="mean")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_all_ignored_is_exactly_zero(gen, backend, device, beta, reduction):
    case = make_case(gen, ignore="all", device=device)
    opts = dict(beta=beta, reduction=reduction, ce_weight=0.5, backend=backend)
    loss = lp.fused_linear_distillation(**case, **opts)
    assert torch.equal(loss, torch.zeros_like(loss)) and loss.requires_grad
    loss.sum().backward()
    for name in STUDENT:
        assert torch.equal(case[name].grad, torch.zeros_like(case[name])), name


def test_no_tokens(gen, backend, device):
    case = make_case(gen, lead=(0,), device=device)
    loss = lp.fused_linear_distillation(**case, beta=0.5, backend=backend)
    assert loss.item() == 0.0
    loss.backward()
    assert case["student_weight"].grad.abs().sum() == 0


@pytest.mark.parametrize("num_items", [5, 23.5, "int_tensor", "float_tensor"])
def test_num_items_in_batch(gen, backend, device, num_items):
    tensors = {"int_tensor": torch.tensor(17), "float_tensor": torch.tensor(9.5)}
    value = tensors[num_items].to(device) if num_items in tensors else num_items
    check(make_case(gen, device=device), gen, backend=backend, beta=0.3, num_items_in_batch=value)


def test_num_items_zero_with_nothing_kept(gen, device):
    case = make_case(gen, ignore="all", device=device)
    loss = lp.fused_linear_distillation(**case, num_items_in_batch=0)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(case["student_hidden"].grad).all()


# ---------------------------------------------------------------- dtypes and layouts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_half_precision(gen, backend, device, dtype, reduction):
    """fp16 takes the recompute path for every reduction; bf16 precomputes with "mean"."""
    case = make_case(gen, dtype=dtype, device=device)
    check(case, gen, backend=backend, tol=TOL[dtype], beta=0.5, ce_weight=0.2, reduction=reduction)


def test_half_inputs_round_once_on_the_cpu(gen):
    """On the CPU the GEMMs and sums run in fp32: with the torch backend (fp32 logits) bf16 inputs
    give the fp32 op's loss on the same (rounded) values and its gradients rounded once to bf16
    (grad_W summed over chunks in fp32). (The Triton backend stores bf16 logits, as a bf16 head
    does: tests/ops/distillation/test_triton_chunk.py.)"""
    case = make_case(gen, lead=(40,), dtype=torch.bfloat16)
    wide = with_dtype(case, torch.float32)
    opts = dict(beta=0.3, reduction="sum", memory_budget=budget_for(3, case), backend="torch")
    half, half_grads = loss_and_grads(lp.fused_linear_distillation, case, torch.tensor(1.0), **opts)
    full, full_grads = loss_and_grads(lp.fused_linear_distillation, wide, torch.tensor(1.0), **opts)
    assert torch.equal(half, full)
    for name, g in half_grads.items():
        assert torch.equal(g, full_grads[name].bfloat16()), name


def test_torch_backend_keeps_fp32_logits_whatever_logits_dtype_says(gen):
    """fp32 logits are the torch backend's only mode: ``logits_dtype`` None, the input's bf16 or
    fp32 give the same results bit for bit (and the options round-trip through the key)."""
    case = make_case(gen, lead=(30,), dtype=torch.bfloat16)
    opts = dict(beta=0.4, ce_weight=0.2, memory_budget=budget_for(7, case), backend="torch")
    results = [
        loss_and_grads(lp.fused_linear_distillation, case, torch.tensor(1.0), logits_dtype=d, **opts)
        for d in (None, torch.bfloat16, torch.float32)
    ]
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(g, results[0][1][name]) for name, g in grads.items())
    options = build_distill_options(logits_dtype=torch.float32)
    assert DistillOptions.from_key(options.key) == options and options.logits_dtype == torch.float32
    assert "logits_dtype=torch.float32" in repr(lp.FusedLinearDistillationLoss(logits_dtype=torch.float32))


def test_fp16_gradients_under_a_loss_scale(gen, backend, device):
    """fp16 gradients are computed with the upstream gradient (a GradScaler's 2^16) already in:
    computed at scale 1 and rounded to fp16 first, these small ones would flush to zero."""
    case = make_case(gen, dtype=torch.float16, device=device)
    tol = TOL[torch.float16]
    check(case, gen, backend=backend, tol=tol, beta=0.5, num_items_in_batch=3e5, upstream=65536.0)


def test_autocast(gen, backend, device):
    """Under bf16 autocast of the inputs' device (CPU or CUDA) the fp32 tensors are used as bf16,
    as nn.Linear would use them; the gradients come back in fp32."""
    case = make_case(gen, device=device)
    rounded = with_dtype(with_dtype(case, torch.bfloat16), torch.float32)
    up = torch.tensor(1.3, device=device)
    opts = dict(beta=0.3, temperature=1.5)
    ref, ref_grads = loss_and_grads(reference_distill, rounded, up, **opts)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss, grads = loss_and_grads(lp.fused_linear_distillation, case, up, backend=backend, **opts)
    tol = TOL[torch.bfloat16]
    assert_close("loss", loss, ref, tol)
    for name, g in grads.items():
        assert g.dtype == torch.float32
        assert_close(f"grad {name}", g, ref_grads[name], tol)


def test_strided_inputs(gen, backend, device):
    """A transposed student weight and hidden states, an expanded (stride 0) teacher input, a
    sliced teacher weight and strided labels give what contiguous copies give. The values are
    drawn on the CPU and moved; the strided views are taken on ``device``, so the op sees them."""
    n = math.prod(LEAD)
    student_hidden = torch.randn(HS, n, generator=gen).to(device).t().reshape(*LEAD, HS).requires_grad_()
    assert not student_hidden.is_contiguous() or student_hidden.reshape(-1).numel() == 0
    student_weight = (torch.randn(HS, V, generator=gen) * 0.7).to(device).t().requires_grad_()
    teacher_hidden = torch.randn(1, LEAD[1], HT, generator=gen).to(device).expand(LEAD[0], LEAD[1], HT)
    teacher_weight = (torch.randn(V, 2 * HT, generator=gen) * 0.5).to(device)[:, ::2]
    labels = torch.randint(0, V, (LEAD[0], 2 * LEAD[1]), generator=gen).to(device)[:, ::2]
    labels[0, 1] = -100
    case = dict(
        student_hidden=student_hidden,
        student_weight=student_weight,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        labels=labels,
        student_bias=torch.randn(2 * V, generator=gen).to(device)[::2].requires_grad_(),
        teacher_bias=None,
    )
    assert not student_weight.is_contiguous() and teacher_hidden.stride(0) == 0
    assert teacher_weight.stride(-1) == labels.stride(-1) == case["student_bias"].stride(0) == 2
    assert all(t is None or t.device.type == device.type for t in case.values())
    check(case, gen, backend=backend, beta=0.3, reduction="none", student_softcap=5.0)


def test_very_different_hidden_sizes(gen, backend, device):
    check(make_case(gen, hs=3, ht=40, device=device), gen, backend=backend, beta=0.5, ce_weight=0.5)


# ---------------------------------------------------------------- the teacher


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_teacher_requiring_grad_gets_none(gen, backend, device, reduction):
    case = make_case(gen, device=device)
    for name in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        case[name].requires_grad_()
    check(case, gen, backend=backend, beta=0.5, reduction=reduction)
    loss = lp.fused_linear_distillation(**case, beta=0.5, reduction=reduction, backend=backend)
    loss.sum().backward()
    assert all(case[k].grad is None for k in ("teacher_hidden", "teacher_weight", "teacher_bias"))
    assert case["student_weight"].grad is not None
    frozen = {k: v.detach() if k.startswith("student") and v is not None else v for k, v in case.items()}
    lp.fused_linear_distillation(**frozen, beta=0.5, reduction=reduction, backend=backend).sum().backward()
    assert all(case[k].grad is None for k in ("teacher_hidden", "teacher_weight", "teacher_bias"))


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_teacher_inference_tensors(gen, backend, device, reduction):
    """Teacher tensors made under torch.inference_mode (TRL runs the teacher under no_grad or
    inference mode) work on both backward paths (precomputed "sum", recomputed "none")."""
    case = make_case(gen, device=device)
    with torch.inference_mode():
        teacher = {k: case[k].clone() for k in ("teacher_hidden", "teacher_weight", "teacher_bias")}
    assert teacher["teacher_weight"].is_inference()
    case.update(teacher)
    check(case, gen, backend=backend, beta=0.3, reduction=reduction)


def test_whole_call_under_inference_mode(gen, device):
    case = make_case(gen, device=device)
    expected = lp.fused_linear_distillation(**case, beta=0.5).detach()
    with torch.inference_mode():
        loss = lp.fused_linear_distillation(**case, beta=0.5)
    assert torch.equal(loss, expected)


# ---------------------------------------------------------------- backward paths


def test_second_backward(gen, device):
    """A retained graph: reduction "none" recomputes every time (same gradients twice); "mean",
    whose forward computed the gradients, refuses a second backward by name."""
    case = make_case(gen, device=device)
    loss = lp.fused_linear_distillation(**case, beta=0.5, reduction="none")
    first = torch.autograd.grad(loss.sum(), case["student_weight"], retain_graph=True)[0]
    second = torch.autograd.grad(loss.sum(), case["student_weight"])[0]
    assert torch.equal(first, second)
    loss = lp.fused_linear_distillation(**case, beta=0.5)
    torch.autograd.grad(loss, case["student_weight"], retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, case["student_weight"])


def test_create_graph_refused(gen, device):
    case = make_case(gen, device=device)
    loss = lp.fused_linear_distillation(**case, beta=0.5)
    with pytest.raises(NotImplementedError, match="second derivative"):
        torch.autograd.grad(loss, case["student_hidden"], create_graph=True)


def test_only_some_student_inputs_require_grad(gen, backend, device):
    case = make_case(gen, device=device)
    case["student_hidden"].requires_grad_(False)
    case["student_bias"].requires_grad_(False)
    check(case, gen, backend=backend, beta=0.3, temperature=2.0)


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("softcaps", [False, True])
def test_working_memory_within_budget(gen, softcaps):
    """The chunk loop allocates, beyond its results (losses and gradients), no more than the
    working bytes of its budget, with chunks as large as they allow; with softcaps on both sides
    (the most buffers at once) it comes close, so ``ROW_BUFFERS`` is the true peak and not a
    loose bound. (Measured on ``run_distill``: a dispatch mode does not see inside the operator.)
    The Triton backend's chunk: tests/ops/distillation/test_triton_chunk.py."""
    case = make_case(gen, lead=(48,), hs=16, ht=24, vocab=3001, ignore="first")
    opts = dict(beta=0.5, ce_weight=0.5, temperature=2.0, teacher_logit_scale=1.3)
    if softcaps:
        opts.update(student_softcap=4.0, teacher_softcap=5.0)
    working = budget_for(10, case) - SLACK_BYTES - PER_TOKEN_BYTES * 48
    student = distillation_chunks.Head(*(case[k].detach() for k in STUDENT))
    teacher = distillation_chunks.Head(case["teacher_hidden"], case["teacher_weight"], case["teacher_bias"])
    labels = case["labels"]
    kept = torch.nonzero(labels != -100).view(-1)
    with LiveBytes() as mode:
        res = distillation_chunks.run_distill(
            distillation_chunks.DistillCall(
                student,
                teacher,
                labels,
                build_distill_options(**opts),
                kept=kept,
                coef=torch.full((48,), 0.1),
                needs=(True, True, True),
                budget_bytes=working,
                math=distillation_chunks.TORCH_MATH,
            )
        )
    results = [res.loss, res.grad_hidden, res.grad_weight, res.grad_bias]
    used = mode.peak - sum(t.numel() * t.element_size() for t in results)
    assert used <= working, (used, working)
    assert used > (0.9 if softcaps else 0.6) * working, (used, working)
    rows = distillation_chunks.distill_chunk_rows(
        distillation_chunks.TORCH_MATH,
        47,
        *sides(case),
        build_distill_options(**opts),
        want_grad=True,
        gathers=True,
        budget=working,
    )
    assert rows == 10


def test_chunks_as_budgeted(gen, monkeypatch, backend, device):
    """``budget_for(rows)`` (what every check here runs with) gives chunks of ``rows`` kept tokens."""
    seen = []
    if backend == "torch":
        module, name = distillation_chunks, "distill_rows"
    else:
        module, name = distillation_triton, "distill_rows_triton"
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda ls, *a, **k: seen.append(len(ls)) or real(ls, *a, **k))
    case = make_case(gen, ignore="first", device=device)
    opts = dict(beta=0.5, backend=backend)
    read = Tuning(wait_to_skip_gflop=0.0)  # on CUDA too the check is read first: skipped at any size
    budget = budget_for(4, case, **opts)
    lp.fused_linear_distillation(**case, memory_budget=budget, tuning=read, **opts).backward()
    assert seen == [4, 4, 4, 1]  # 13 kept tokens, in the forward (the backward only scales)


# ---------------------------------------------------------------- entry points


def test_module_matches_functional(gen, device):
    case = make_case(gen, device=device)
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
def test_compiled_matches_eager(gen, device, reduction):
    """torch.compile(fullgraph=True) of a call (dynamic shapes, the temperature from a variable)
    gives the eager loss and gradients, for another length and another temperature too."""
    case = make_case(gen, device=device)

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


def test_options_reach_the_graph_as_plain_constants():
    """The functional hands its options to ``build_distill_options`` as plain constants: a float as
    its exact hex string, a ``Tuning`` as its key. torch 2.11's dynamo cannot rebuild a frozen
    dataclass there ("currently can't reconstruct arbitrary frozen dataclass instances": every
    compiled call failed on a GPU with torch 2.11 while the Tuning went as itself)."""
    tuning = Tuning(chunk_rows=7)
    given = dict(beta=0.5, temperature=0.3, tuning=tuning, reduction="sum")
    encoded = constant_changes(given)
    assert all(isinstance(value, str) for value in encoded.values())
    assert build_distill_options(**encoded) == build_distill_options(**given)
    assert build_distill_options(**encoded).tuning == tuning


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_module(gen, device):
    case = make_case(gen, device=device)
    module = lp.FusedLinearDistillationLoss(beta=1.0, temperature=1.5)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    assert_close("compiled module", compiled(**case), module(**case), 1e-6)
