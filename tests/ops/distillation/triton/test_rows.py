"""The distillation row kernel (``ops/distillation/triton/rows.py``) on its own: each row's loss and its
gradient against the fp64 reference, ignored rows (which the op never gives it: it walks kept
rows only) writing zeros, a gradient buffer apart from the logits, a half gradient written into
fp32 logits' own bytes, and compiling for Hopper.

The op through the kernel, over chunks and with the fused GEMM's partials, is
tests/ops/distillation/test_triton_chunk.py's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from liger_patch.ops.core.gemm import grad_view
from liger_patch.ops.distillation.options import build_distill_options
from tests.ops.distillation.cases import divergence_input, reference_rows

triton_distill = pytest.importorskip("liger_patch.ops.distillation.triton.rows")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

ROWS, V = 7, 131


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.37])
def test_rows_against_reference_with_ignored_rows(gen, device, beta):
    """Mixed dtypes (bf16 student, fp32 teacher), a separate fp32 gradient buffer full of NaN:
    kept rows get the reference's loss and ``coef * d loss / d x``, ignored ones 0 and zeros."""
    opts = build_distill_options(
        beta=beta,
        temperature=1.8,
        ce_weight=0.4,
        student_softcap=5.0,
        teacher_softcap=7.0,
        student_logit_scale=1.2,
        ignore_index=-1,
        backend="triton",
    )
    xs = (torch.randn(ROWS, V, generator=gen) * 3).bfloat16().to(device)
    xt = (torch.randn(ROWS, V, generator=gen) * 3).to(device)
    labels = torch.randint(0, V, (ROWS,), generator=gen)
    labels[[1, 4]] = -1
    labels = labels.to(device)
    coef = (torch.rand(ROWS, generator=gen) + 0.5).to(device)
    grad = torch.full((ROWS, V), float("nan"), device=device)
    loss = triton_distill.distill_rows_triton(xs, xt, labels, opts, grad=grad, coef=coef)

    x = xs.double().requires_grad_()
    zs, zt = divergence_input(x, 1.2, 5.0), divergence_input(xt, None, 7.0)
    expected = reference_rows(zs, zt, labels, beta=beta, temperature=1.8, ce_weight=0.4, ignore_index=-1)
    (expected_grad,) = torch.autograd.grad((expected * coef.double()).sum(), x)
    torch.testing.assert_close(loss.double(), expected, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)
    assert (loss[[1, 4]] == 0).all() and (grad[[1, 4]] == 0).all()
    assert torch.equal(triton_distill.distill_rows_triton(xs, xt, labels, opts), loss)  # no gradient


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.37])
def test_half_gradient_in_fp32_logits_bytes(gen, device, beta):
    """fp32 logits (``logits_dtype=torch.float32``) with a bf16 gradient in their own bytes
    (``gemm.grad_view``, as the op lays it out on a GPU): each row's gradient overwrites the first half of its
    logits while the last pass still reads them. The pass walks forwards (the default tuning
    reverses it for beta 0 and 1), so the loss equals a run with a separate fp32 buffer bit for
    bit and the gradient is that run's, rounded to bf16 (the interpreter's rounding may differ
    from torch's: within an ulp); ignored rows get zeros."""
    opts = build_distill_options(beta=beta, temperature=1.5, ce_weight=0.3, student_softcap=6.0)
    xs = torch.randn(ROWS, V, generator=gen) * 3
    xt = (xs + torch.randn(ROWS, V, generator=gen)).to(device)
    xs = xs.to(device)
    labels = torch.randint(0, V, (ROWS,), generator=gen)
    labels[2] = -100
    labels = labels.to(device)
    coef = (torch.rand(ROWS, generator=gen) + 0.5).to(device)
    apart = torch.empty(ROWS, V, device=device)
    expected = triton_distill.distill_rows_triton(xs, xt, labels, opts, grad=apart, coef=coef)
    logits = xs.clone()
    grad = grad_view(logits, torch.bfloat16)
    assert grad.data_ptr() == logits.data_ptr() and grad.stride(0) == 2 * V
    loss = triton_distill.distill_rows_triton(logits, xt, labels, opts, grad=grad, coef=coef)
    assert torch.equal(loss, expected)
    assert ((grad.float() - apart).abs() <= 2.0**-7 * apart.abs()).all() and (grad[2] == 0).all()  # an ulp


def test_refuses_what_it_cannot_use():
    opts = build_distill_options(beta=1.0)
    logits, labels = torch.zeros(3, 8), torch.zeros(3, dtype=torch.long)
    parts = ((torch.zeros(3, 2), torch.ones(3, 2)),) * 2
    with pytest.raises(ValueError, match="no partials"):
        triton_distill.distill_rows_triton(logits, logits, labels, opts, partials=parts)
    with pytest.raises(ValueError, match="differ in shape"):
        triton_distill.distill_rows_triton(logits, logits[:2], labels, opts)
    for grad in (
        torch.zeros(3, 8, dtype=torch.bfloat16),  # narrower, elsewhere
        logits.view(torch.bfloat16)[:, 8:],  # narrower, in the logits' bytes but off their row starts
    ):
        with pytest.raises(ValueError, match="at least as wide"):
            triton_distill.distill_rows_triton(logits, logits, labels, opts, grad=grad, coef=torch.ones(3))


# (BETA_MODE, HAS_CE, CE_SCALED, (S_SOFTCAP, T_SOFTCAP), HAS_PARTIALS, COMPUTE_GRAD, student, teacher,
#  grad dtypes, GRAD_ALIASES_WIDER)
BOTH, NEITHER = (True, True), (False, False)
VARIANTS = [
    (0, False, False, NEITHER, True, True, "*bf16", "*bf16", "*bf16", False),
    (0, True, True, BOTH, False, False, "*bf16", "*bf16", "*bf16", False),
    (0, True, True, NEITHER, True, True, "*fp16", "*fp16", "*fp16", False),
    (1, True, True, BOTH, False, True, "*fp32", "*bf16", "*fp32", False),
    (2, True, True, BOTH, True, True, "*bf16", "*bf16", "*bf16", False),
    (2, True, False, NEITHER, False, True, "*bf16", "*fp32", "*bf16", False),
    (0, True, True, BOTH, False, True, "*fp32", "*fp32", "*bf16", True),
    (2, False, False, NEITHER, False, True, "*fp32", "*fp32", "*bf16", True),
    # one side capped: its slope a tensor, the other's the constant 1.0 (final_block)
    (2, True, True, (True, False), False, True, "*bf16", "*bf16", "*bf16", False),
    (1, False, False, (False, True), False, True, "*bf16", "*bf16", "*bf16", False),
]

COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from liger_patch.ops.core.triton.common import fold_partials, sfu_log, softcap
from liger_patch.ops.distillation.triton.rows import (
    _distill_rows_kernel, final_block, launch_config, mixture_terms,
)
from liger_patch.ops.core.tuning import Tuning

pointers = ["s_ptr", "t_ptr", "grad_ptr", "labels_ptr", "coef_ptr", "loss_ptr",
            "s_pmax_ptr", "s_psum_ptr", "t_pmax_ptr", "t_psum_ptr"]
scalars = {"n_parts": "i32", "stride_s": "i64", "stride_t": "i64", "stride_grad": "i64", "V": "i32",
           "ignore_index": "i64", "s_scale": "fp32", "s_cap": "fp32", "t_scale": "fp32", "t_cap": "fp32",
           "log_beta": "fp32", "log_1m_beta": "fp32", "inv_1m_beta": "fp32", "ce_weight": "fp32",
           "temperature": "fp32"}
block, warps = launch_config(128256, Tuning(), interpret=False)
kernel, softcap_fn, fold_fn = triton.jit(_distill_rows_kernel), triton.jit(softcap), triton.jit(fold_partials)
final_fn, mix_fn = triton.jit(final_block), triton.jit(mixture_terms)
report = []
for mode, ce, scaled, (s_cap, t_cap), partials, grad, s_dtype, t_dtype, g_dtype, aliases in json.loads(
    sys.argv[1]
):
    signature = {name: "*fp32" for name in pointers}
    signature.update(s_ptr=s_dtype, t_ptr=t_dtype, grad_ptr=g_dtype, labels_ptr="*i64", **scalars)
    stats = (not partials) or (scaled and mode != 2)
    constexprs = dict(BETA_MODE=mode, HAS_CE=ce, CE_SCALED=scaled, S_SOFTCAP=s_cap, T_SOFTCAP=t_cap,
                      HAS_PARTIALS=partials, STATS_PASS=stats, LAST_D=mode == 0 and partials,
                      COMPUTE_GRAD=grad, GRAD_ALIASES_WIDER=aliases, REVERSE_K=stats, REVERSE_LAST=False,
                      BLOCK_V=block, BLOCK_P=1024, SOFTCAP_FN=softcap_fn, FOLD_FN=fold_fn,
                      FINAL_FN=final_fn, MIX_FN=mix_fn if mode == 2 else None,
                      LOG_FN=triton.jit(sfu_log) if mode == 2 else None)
    signature.update({name: "constexpr" for name in constexprs})
    names = list(signature)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    stores = compiled.asm["ptx"].count("st.global")
    report.append({"cubin_bytes": len(compiled.asm["cubin"]), "stores": stores})
print(json.dumps([block, warps, report]))
"""


def test_kernel_compiles_for_sm90():
    """Every branch of the kernel compiles for Hopper with the launch of V=128256 (4096 columns
    of each side per step, 16 warps), in a fresh interpreter without TRITON_INTERPRET (see
    test_kernel_builds.py); the variants without a gradient store the loss only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(VARIANTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    block, warps, report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (block, warps) == (4096, 16)
    for variant, built in zip(VARIANTS, report, strict=True):
        assert built["cubin_bytes"] > 0, f"no cubin for {variant}"
        # the loss of an ignored row and of a kept one; with a gradient, zeros and the gradient too
        assert (built["stores"] > 2) == variant[5], (variant, built)
