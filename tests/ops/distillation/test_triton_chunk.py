"""The Triton backend of ``fused_linear_distillation`` (``ops/distillation/triton_chunk.py``, the row
kernel ``ops/distillation/triton/rows.py``) on ``device``: its kernels run natively on CUDA tensors where
there is a GPU, and under the Triton interpreter on CPU tensors otherwise (tests/conftest.py sets
TRITON_INTERPRET=1 only without CUDA). Cases are drawn on the CPU from the seeded generator and
moved, so a test sees the same values on every device.

What both backends share (every option, ignored tokens, reductions, dtypes, layouts, the
teacher, the backward paths) is tests/ops/distillation/test_loss.py's, run on both. Here: odd sizes
over several chunks for every kind of beta, with and without the fused logits GEMM's
log-sum-exp partials (where it takes the inputs' dtype: fp32 under the interpreter, bf16 / fp16
on a GPU; a vocabulary whose rows are 16-byte aligned takes them, an odd one does not),
agreement with the PyTorch backend, logits kept in the input dtype (bf16 results against a
reference on the same rounded logits) or in fp32 (``logits_dtype``), and the chunk's memory.
What differs between the devices: the GEMMs run in fp32 on the CPU and in the inputs' dtype on a
GPU (``gemm.gemm_dtype_for``), so a bf16 student's gradient is fp32 on the CPU and bf16 on a GPU,
where it is written into the student's logits' bytes. The one test that emulates the GPU's
layout on the CPU is skipped on a GPU, which runs the real one.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import _disable_current_modes

import liger_patch as lp
from liger_patch.ops.core import gemm
from liger_patch.ops.core.backends import pick
from liger_patch.ops.core.budget import PER_TOKEN_BYTES, SLACK_BYTES, working_bytes
from liger_patch.ops.core.gemm import gemm_dtype_for
from liger_patch.ops.core.triton import logits as triton_logits
from liger_patch.ops.distillation import chunks as distillation_chunks
from liger_patch.ops.distillation import triton_chunk as distillation_triton
from liger_patch.ops.distillation.chunks import DistillCall, Head, Side, distill_chunk_rows, run_distill
from liger_patch.ops.distillation.options import build_distill_options
from liger_patch.ops.distillation.triton import rows as triton_distill
from tests.op_helpers import IGNORE_PATTERNS, examples
from tests.ops.distillation.cases import (
    STUDENT,
    LiveBytes,
    assert_near,
    budget_for,
    check,
    correlated_case,
    divergence_input,
    loss_and_grads,
    make_case,
    reduce_reference,
    reference_distill,
    reference_rows,
    rounding_floors,
    with_dtype,
)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# Hypothesis tests cannot take function-scoped fixtures: the ``device`` fixture's device, by hand.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# What the fused logits GEMM takes (``triton/logits.py``'s ``supported``): fp32 inputs under the
# interpreter, half ones on CUDA (an sm90 GPU), whose fp32 inputs go through cuBLAS, no partials.
FUSED_DTYPE = torch.bfloat16 if torch.cuda.is_available() else torch.float32

N, HS, HT = 37, 24, 40
ODD_V, ALIGNED_V = 131, 136  # 136 fp32 or bf16 logits make 16-byte aligned rows: the fused GEMM
RANDOM_BETA = 0.37
BF16_ROUNDING = 2.0**-8  # one rounding to bf16, relative (half an ulp is 2^-9)

OPTIONS = {
    "plain": dict(),
    "temperature_ce": dict(temperature=2.5, ce_weight=0.3),
    "caps_scales": dict(
        temperature=0.8,
        student_softcap=3.0,
        teacher_softcap=5.0,
        student_logit_scale=1.3,
        teacher_logit_scale=-0.7,
    ),
    "ce_only": dict(ce_weight=1.0, temperature=1.7, student_softcap=6.0),
}


@pytest.fixture
def logits_calls(monkeypatch):
    """For each logits chunk the Triton chunk made (the teacher's first one possibly in parts by the
    head start), whether the fused GEMM's partials came with it."""
    calls = []
    real = gemm.chunk_logits

    def counted(*args, **kwargs):
        logits, partials = real(*args, **kwargs)
        calls.append(partials is not None)
        return logits, partials

    monkeypatch.setattr(distillation_triton, "chunk_logits", counted)
    monkeypatch.setattr(gemm, "chunk_logits", counted)
    return calls


CASES = [
    (beta, options, [ALIGNED_V, ODD_V][(i + j) % 2])
    for i, beta in enumerate([0.0, 1.0, 0.5, RANDOM_BETA])
    for j, options in enumerate(OPTIONS)
]
"""Every beta with every option set, each beta and each set with both vocabularies."""


@pytest.mark.parametrize(("beta", "options", "vocab"), CASES, ids=str)
def test_matches_reference_over_chunks(gen, device, logits_calls, beta, options, vocab):
    """Every kind of beta against the fp64 reference, in chunks of 10 kept tokens (and a
    remainder), the reduction cycling over the cases; the partials are taken where the fused GEMM
    takes the fp32 inputs (under the interpreter; on a GPU cuBLAS makes every chunk), the rows are
    aligned and the divergence can use them (not beta = 1), for both sides of every chunk."""
    reduction = ["mean", "sum", "none"][CASES.index((beta, options, vocab)) % 3]
    case = make_case(gen, (N,), HS, HT, vocab, ignore="mixed", bias=options != "plain", device=device)
    check(case, gen, backend="triton", rows=10, beta=beta, reduction=reduction, **OPTIONS[options])
    fused = case["student_hidden"].dtype == FUSED_DTYPE and vocab == ALIGNED_V and beta != 1.0
    chunks = math.ceil(int((case["labels"] != -100).sum()) / 10)  # the seed sets how many are kept
    assert len(logits_calls) >= 2 * chunks and set(logits_calls) == {fused}, logits_calls


def test_larger_vocabulary_spans_many_blocks(gen, device):
    case = make_case(gen, (N,), HS, HT, 517, ignore="runs", device=device)
    check(case, gen, backend="triton", rows=16, beta=RANDOM_BETA, temperature=1.6, ce_weight=0.3)


@pytest.mark.parametrize(("beta", "vocab"), [(0.0, ODD_V), (1.0, ALIGNED_V), (RANDOM_BETA, ALIGNED_V)])
def test_agrees_with_the_torch_backend(gen, device, beta, vocab):
    """fp32 inputs: the two backends' losses and gradients agree to fp32 rounding."""
    case = make_case(gen, (N,), HS, HT, vocab, ignore="every_other", device=device)
    opts = dict(beta=beta, temperature=1.4, ce_weight=0.2, student_softcap=5.0, reduction="sum")
    up = torch.tensor(0.7, device=device)
    results = {}
    for backend in ("torch", "triton"):
        budget = budget_for(6, case, backend, beta=beta)
        results[backend] = loss_and_grads(
            lp.fused_linear_distillation, case, up, backend=backend, memory_budget=budget, **opts
        )
    (loss_t, grads_t), (loss_k, grads_k) = results["torch"], results["triton"]
    torch.testing.assert_close(loss_k, loss_t, rtol=2e-6, atol=2e-6)
    for name in grads_t:
        torch.testing.assert_close(
            grads_k[name], grads_t[name], rtol=2e-5, atol=2e-6 * grads_t[name].abs().max()
        )


def _rounded_logits(case: dict, side: str) -> torch.Tensor:
    """What the op's chunk holds: the GEMM of the bf16 inputs accumulated in fp32 (plus the bias),
    rounded once to bf16, in fp64. On the CPU the GEMM runs in fp32 and adds the fp32 bias; on a
    GPU the bf16 GEMM accumulates in fp32, adds the bias rounded to bf16 (exact here: the case's
    bias is bf16) and rounds once too: the same values up to the order of the fp32 sums. (A few
    of these cases' logits lie within an fp32 rounding of a bf16 tie; rounded the other way, any
    one of them moves the reference loss by at most 15 % of the test's bound.)"""
    hidden = case[f"{side}_hidden"].detach().float()
    x = hidden.reshape(-1, hidden.shape[-1]) @ case[f"{side}_weight"].detach().float().T
    bias = case[f"{side}_bias"]
    if bias is not None:
        x = x + bias.detach().float()
    return x.bfloat16().double()


@pytest.mark.parametrize(("beta", "vocab"), [(0.0, ALIGNED_V), (1.0, ODD_V), (RANDOM_BETA, ALIGNED_V)])
def test_bf16_logits_are_what_the_loss_sees(gen, device, beta, vocab):
    """bf16 inputs: the chunks hold bf16 logits (as a bf16 head stores them) and all the math
    after them is fp32, so the loss matches an fp64 reference computed from the same rounded
    logits to fp32 accuracy. Where the gradient GEMMs run in fp32 (the CPU), each gradient is
    that reference's, rounded once to bf16; on a GPU they run in bf16 from the kernel's bf16
    gradient, as a bf16 head's backward does, so only their dtype is checked here. (Against the
    unrounded reference, bf16 tolerance on both: test_distillation.py's test_half_precision.)"""
    case = make_case(gen, (N,), HS, HT, vocab, dtype=torch.bfloat16, ignore="first_and_last", device=device)
    opts = dict(beta=beta, temperature=1.3, ce_weight=0.25, teacher_softcap=4.0, student_logit_scale=0.9)
    up = torch.tensor(1.0, dtype=torch.float64, device=device)
    xs = _rounded_logits(case, "student").requires_grad_()
    xt = _rounded_logits(case, "teacher")
    zs = divergence_input(xs, opts["student_logit_scale"], None)
    zt = divergence_input(xt, None, opts["teacher_softcap"])
    math_opts = dict(beta=beta, temperature=opts["temperature"], ce_weight=opts["ce_weight"])
    ref = reduce_reference(reference_rows(zs, zt, case["labels"], **math_opts), case["labels"])
    (g_x,) = torch.autograd.grad(ref, xs)
    h = case["student_hidden"].detach().double().reshape(N, HS)
    ref_grads = {
        "student_hidden": (g_x @ case["student_weight"].detach().double()).reshape(
            case["student_hidden"].shape
        ),
        "student_weight": g_x.T @ h,
        "student_bias": g_x.sum(0),
    }
    budget = budget_for(9, case, "triton", beta=beta)
    loss, grads = loss_and_grads(
        lp.fused_linear_distillation, case, up.float(), backend="triton", memory_budget=budget, **opts
    )
    floors = rounding_floors(with_dtype(case, torch.float64), up, opts)
    assert_near("loss", loss, ref, 1e-6, floors["loss"])
    fp32_gradient_gemms = gemm_dtype_for(case["student_hidden"]) == torch.float32
    for name in STUDENT:
        expected = ref_grads[name]
        assert grads[name].dtype == torch.bfloat16
        if not fp32_gradient_gemms:
            continue
        bound = BF16_ROUNDING * expected.abs() + 1e-5 * expected.abs().max() + floors[name]
        assert ((grads[name].double() - expected).abs() <= bound).all(), name


@pytest.fixture
def kernel_reads(monkeypatch):
    """For each row kernel launch: the student's and the teacher's logits dtypes, the gradient's
    dtype and whether it lies in the student's logits' bytes, and whether partials came with it."""
    seen = []
    real = distillation_triton.distill_rows_triton

    def spy(student, teacher, labels, opts, *, grad=None, coef=None, partials=None):
        in_place = grad is not None and grad.data_ptr() == student.data_ptr()
        g = None if grad is None else (grad.dtype, in_place)
        seen.append((student.dtype, teacher.dtype, g, partials is not None))
        return real(student, teacher, labels, opts, grad=grad, coef=coef, partials=partials)

    monkeypatch.setattr(distillation_triton, "distill_rows_triton", spy)
    return seen


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach()
    return float((actual.detach().double() - expected).norm() / expected.norm())


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5, RANDOM_BETA])
def test_fp32_logits_are_closer_to_fp64_than_bf16_ones(gen, device, kernel_reads, beta):
    """bf16 inputs, a teacher correlated with the student at rho = 0.9 (the gradient p_s - p_t a
    small difference), against an fp64 reference from the same bf16 inputs: with
    ``logits_dtype=torch.float32`` the kernel reads fp32 logits (no partials: the statistics
    pass) and the loss is fp32-exact, each gradient (where the gradient GEMMs run in fp32: the
    CPU) within one bf16 rounding of the reference; with bf16 logits (the default, as a bf16
    head) errors are about ten times larger (on an H100 at 1024 x 512 x 8191: loss 2.5e-4, grads
    2.3e-2, against 3e-7 and 2.3e-3 for TRL's fp32 tiles). Here (48 x 32 x 136), the gradients:
    bf16 ~1.5e-2, fp32 ~1.6e-3 on the CPU; fp32 ~2.5e-3 with a GPU's bf16 gradient GEMMs
    (emulated on the CPU: 6-7.5 times less than bf16). The kernel writes the gradient in the
    gradient GEMMs' dtype: fp32 on the CPU (a buffer of its own beside bf16 logits), bf16 on a GPU
    (over bf16 logits, or into fp32 logits' bytes)."""
    case = correlated_case(gen, 48, 32, ALIGNED_V, rho=0.9, device=device)
    opts = dict(beta=beta, backend="triton")
    up = torch.tensor(1.0, dtype=torch.float64, device=device)
    ref, ref_grads = loss_and_grads(reference_distill, with_dtype(case, torch.float64), up, beta=beta)
    grad_dtype = gemm_dtype_for(case["student_hidden"])
    errors = {}
    for logits_dtype in (None, torch.float32):
        kernel_reads.clear()
        loss, grads = loss_and_grads(
            lp.fused_linear_distillation, case, up.float(), logits_dtype=logits_dtype, **opts
        )
        stored = torch.float32 if logits_dtype else torch.bfloat16
        partials = logits_dtype is None and beta != 1.0
        in_place = stored.itemsize >= grad_dtype.itemsize
        assert kernel_reads == [(stored, stored, (grad_dtype, in_place), partials)]
        errors[logits_dtype] = {"loss": _relative_error(loss, ref)} | {
            name: _relative_error(g, ref_grads[name]) for name, g in grads.items()
        }
        if logits_dtype is not None:
            assert errors[logits_dtype]["loss"] < 1e-6, errors
        if logits_dtype is not None and grad_dtype == torch.float32:  # fp32 gradient GEMMs: the CPU
            for name, g in grads.items():
                expected = ref_grads[name]
                bound = BF16_ROUNDING * expected.abs() + 1e-5 * expected.abs().max()
                assert ((g.double() - expected).abs() <= bound).all(), name
    half, full = errors[None], errors[torch.float32]
    assert all(5 * full[name] < half[name] for name in half), f"bf16 logits {half}, fp32 logits {full}"


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="emulates the GPU's layout on the CPU under the interpreter (bf16 GEMMs, whose fp32 logits hold "
    "bf16 products there); a GPU's fp32 logits hold the GEMM's fp32 sums, so the two paths differ by "
    "design: there test_fp32_logits_are_closer_to_fp64_than_bf16_ones checks the real layout",
)
def test_fp32_logits_take_a_half_gradient_in_their_bytes(gen, monkeypatch, kernel_reads):
    """The GPU's layout, emulated on the CPU by running the GEMMs in the inputs' bf16: fp32 logits
    chunks (this torch has no CPU ``mm(out_dtype=float32)``, so they hold bf16 products), the
    row kernel writing the bf16 gradient into the student's logits' own bytes (a narrower view,
    rows strided by twice their width), cuBLAS's role reading it for grad_h and grad_W. Over
    chunks of 7 kept tokens the results equal the bf16-logits path's bit for bit: the same
    logit values, the same gradient values, the same bf16 GEMMs."""
    monkeypatch.setattr(distillation_chunks, "gemm_dtype_for", lambda t: t.dtype)
    case = correlated_case(gen, 40, 24, ODD_V, rho=0.9)
    results = {}
    for logits_dtype in (None, torch.float32):
        opts = dict(beta=RANDOM_BETA, ce_weight=0.2, temperature=1.5, logits_dtype=logits_dtype)
        budget = budget_for(7, case, "triton", **opts)
        results[logits_dtype] = loss_and_grads(
            lp.fused_linear_distillation,
            case,
            torch.tensor(1.0),
            backend="triton",
            memory_budget=budget,
            **opts,
        )
    narrow = (torch.float32, torch.float32, (torch.bfloat16, True), False)
    assert kernel_reads[-1] == narrow and len(set(kernel_reads)) == 2 and len(kernel_reads) == 2 * 5
    (loss_h, grads_h), (loss_f, grads_f) = results[None], results[torch.float32]
    assert torch.equal(loss_f, loss_h)
    for name, g in grads_f.items():
        assert g.dtype == torch.bfloat16 and torch.equal(g, grads_h[name]), name


@examples(0.03)
@given(
    beta=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
    temperature=st.floats(0.4, 3.0),
    ce_weight=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    caps=st.tuples(st.none() | st.floats(1.0, 8.0), st.none() | st.floats(1.0, 8.0)),
    vocab=st.sampled_from([3, 64, 97, ALIGNED_V]),
    n=st.integers(1, 13),
    rows=st.integers(1, 6),
    ignore=st.sampled_from(IGNORE_PATTERNS),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    seed=st.integers(0, 2**16),
)
def test_matches_reference_drawn(beta, temperature, ce_weight, caps, vocab, n, rows, ignore, reduction, seed):
    gen = torch.Generator().manual_seed(seed)
    case = make_case(gen, (n,), 8, 12, vocab, bias=bool(seed % 2), ignore=ignore, device=DEVICE)
    opts = dict(beta=beta, temperature=temperature, ce_weight=ce_weight, reduction=reduction)
    check(case, gen, backend="triton", rows=rows, student_softcap=caps[0], teacher_softcap=caps[1], **opts)


class _UnseenLaunches:
    """A kernel whose launches ``LiveBytes`` does not see: the interpreter's copies of the
    arguments, which a GPU does not make."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            with _disable_current_modes():
                return launch(*args, **kwargs)

        return run


def _hide_launches(monkeypatch, module, kernel) -> None:
    real = module.jitted

    def jitted(fn, *interpret):
        return _UnseenLaunches(real(fn, *interpret)) if fn is kernel else real(fn, *interpret)

    monkeypatch.setattr(module, "jitted", jitted)


@pytest.mark.parametrize(
    ("beta", "vocab", "logits_dtype"),
    [(RANDOM_BETA, 520, None), (1.0, 521, None), (RANDOM_BETA, 520, torch.float32)],
)
def test_working_memory_within_budget(gen, device, monkeypatch, beta, vocab, logits_dtype):
    """The Triton chunk allocates, beyond the results, no more than the working bytes of its
    budget (and the per-token share), and comes close to them: its bytes per row
    (``_row_bytes``) are the true peak. The inputs are in what the fused GEMM takes (fp32 on the
    CPU, bf16 on a GPU); with an aligned vocabulary the partials are among them; reverse KL
    takes none, nor do fp32 logits (of bf16 hidden states here, beside weights in the GEMMs'
    dtype, so that no copy of them is made: fp32 on the CPU, bf16 on a GPU; 4 bytes a logit, the
    gradient written over them). A bias only on the CPU, whose fp32 GEMMs add it as it is: a
    GPU's half GEMMs add it rounded to the logits' dtype, a copy of V elements per chunk and side,
    which the budget's slack holds, not its rows. (Under the interpreter its copies of the
    kernels' arguments, which a GPU does not make, are not counted.)"""
    _hide_launches(monkeypatch, triton_distill, triton_distill._distill_rows_kernel)
    _hide_launches(monkeypatch, triton_logits, triton_logits._logits_lse_kernel)
    bias = device.type == "cpu"
    case = make_case(gen, (48,), 16, 24, vocab, ignore="first", dtype=FUSED_DTYPE, bias=bias, device=device)
    if logits_dtype is not None:
        for side in ("student", "teacher"):
            hidden = case[f"{side}_hidden"] = case[f"{side}_hidden"].detach().bfloat16()
            case[f"{side}_weight"] = case[f"{side}_weight"].detach().to(gemm_dtype_for(hidden))
    opts = dict(beta=beta, ce_weight=0.5, temperature=2.0, student_softcap=4.0, logits_dtype=logits_dtype)
    working = budget_for(10, case, "triton", **opts) - SLACK_BYTES - PER_TOKEN_BYTES * 48
    labels = case["labels"]
    student = Head(*(None if case[k] is None else case[k].detach() for k in STUDENT))
    teacher = Head(case["teacher_hidden"], case["teacher_weight"], case["teacher_bias"])
    kept = torch.nonzero(labels != -100).view(-1)
    math = distillation_triton.triton_math(pick("triton", labels.device))
    coef = torch.full((48,), 0.1, device=device)
    with LiveBytes(*case.values(), kept, coef) as mode:
        res = run_distill(
            DistillCall(
                student,
                teacher,
                labels,
                build_distill_options(backend="triton", **opts),
                kept=kept,
                coef=coef,
                needs=(True, True, True),
                budget_bytes=working,
                math=math,
            )
        )
    results = [res.loss, res.grad_hidden, res.grad_weight, res.grad_bias]
    used = mode.peak - sum(t.numel() * t.element_size() for t in results if t is not None)
    # Beside the chunk: its rows' labels, coefficients and losses (16 bytes a row), which the
    # budget's per-token share covers.
    assert 0.95 * working < used <= working + 16 * 10, (used, working)


def test_two_logits_buffers_per_chunk_in_the_input_dtype(gen, device, monkeypatch):
    """Each chunk holds the student's and the teacher's logits in their inputs' dtypes (a bf16
    teacher beside an fp32 student here) and the kernel writes the gradient over the student's
    (fp32 inputs run fp32 GEMMs on every device, so it stays in place)."""
    seen = []
    real = distillation_triton.distill_rows_triton

    def spy(student, teacher, labels, opts, *, grad=None, coef=None, partials=None):
        seen.append(
            (student.dtype, teacher.dtype, grad is not None and grad.data_ptr() == student.data_ptr())
        )
        return real(student, teacher, labels, opts, grad=grad, coef=coef, partials=partials)

    monkeypatch.setattr(distillation_triton, "distill_rows_triton", spy)
    case = make_case(gen, (N,), HS, HT, ODD_V, device=device)
    case.update(
        with_dtype({k: case[k] for k in ("teacher_hidden", "teacher_weight", "teacher_bias")}, torch.bfloat16)
    )
    lp.fused_linear_distillation(**case, beta=0.5, backend="triton").backward()
    assert seen == [(torch.float32, torch.bfloat16, True)]


def _gpu_sides(vocab: int, hidden: int, tokens: int) -> tuple[Side, Side]:
    """bf16 student and teacher as the chunk GEMMs read them on a GPU (weights in bf16), on the
    meta device: shapes and dtypes only."""
    head = Head(
        torch.empty(tokens, hidden, dtype=torch.bfloat16, device="meta"),
        torch.empty(vocab, hidden, dtype=torch.bfloat16, device="meta"),
        None,
    )
    return Side(head.hidden, head.weight, None), Side(head.hidden, head.weight, None)


@pytest.mark.parametrize(
    ("logits_dtype", "row_bytes", "rows"),
    [(None, 4 * 128256 + 2 * 4008 + 4096, 768), (torch.float32, 8 * 128256 + 4096, 512)],
)
def test_bytes_per_row_on_a_gpu(device, monkeypatch, logits_dtype, row_bytes, rows):
    """V = 128256, H_s = 2048, bf16, kept rows gathered (a 4 KiB hidden row), 8192 tokens, the
    default 512 MiB budget: bf16 logits take 2 x 2V bytes and the partials (V/32 a side), fp32
    ones 2 x 4V and no partials (the half gradient lies in the student's bytes): 768 and 512
    rows a chunk (docs/distillation.md's table). (The backend is picked for ``device``: Triton
    runs on CPU tensors only under the interpreter.)"""
    student, teacher = _gpu_sides(128256, 2048, 8192)
    opts = build_distill_options(beta=0.5, backend="triton", logits_dtype=logits_dtype)
    math_ = distillation_triton.triton_math(pick("triton", device))
    monkeypatch.setattr(triton_logits.env, "triton_interpret", lambda: False)  # the GPU's tiles
    assert math_.row_bytes(128256, student, teacher, opts, True, True) == row_bytes
    budget = working_bytes(None, 8192, 8192 * 2048 * 2)
    step = distill_chunk_rows(
        math_, 7000, student, teacher, opts, want_grad=True, gathers=True, budget=budget
    )
    assert step == rows


def test_auto_is_triton_on_cuda_or_under_the_interpreter(gen, device, monkeypatch):
    """``backend="auto"`` runs the Triton kernels where they run: natively on CUDA tensors, under
    the interpreter on CPU tensors."""
    calls = []
    real = distillation_triton.distill_rows_triton
    monkeypatch.setattr(
        distillation_triton, "distill_rows_triton", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    case = make_case(gen, (5,), 4, 4, 11, device=device)
    lp.fused_linear_distillation(**case)
    assert calls == [1]
    lp.fused_linear_distillation(**case, backend="torch")
    assert calls == [1]


def test_extreme_logits_stay_finite(gen, device):
    """Logits spread far apart (|a| in the hundreds: probabilities that underflow, a mixture
    dominated by one side) and tokens whose student and teacher agree exactly give finite
    losses and gradients, and 0 at ignored tokens."""
    case = make_case(gen, (9,), 6, 6, ALIGNED_V, spread=400.0, ignore="half", device=device)
    case["teacher_hidden"][:3] = case["student_hidden"].detach()[:3]
    case["teacher_weight"] = case["student_weight"].detach().clone()
    case["teacher_bias"] = case["student_bias"].detach().clone()
    for beta in (0.0, 1.0, RANDOM_BETA):
        loss = lp.fused_linear_distillation(
            **case, beta=beta, ce_weight=0.1, reduction="none", backend="triton"
        )
        loss.sum().backward()
        assert torch.isfinite(loss).all() and all(torch.isfinite(case[k].grad).all() for k in STUDENT)
        assert (loss[case["labels"] == -100] == 0).all()
        for k in STUDENT:
            case[k].grad = None


def test_module_runs_triton(gen, device):
    case = make_case(gen, (N,), HS, HT, ODD_V, device=device)
    module = lp.FusedLinearDistillationLoss(beta=RANDOM_BETA, temperature=2.0, backend="triton")
    expected = lp.fused_linear_distillation(**case, beta=RANDOM_BETA, temperature=2.0, backend="triton")
    assert torch.equal(module(**case), expected)
    assert math.isfinite(expected.item())
