"""The distillation row kernels of a vocabulary shard (``ops/distillation/triton/shard_rows.py``) on their
own: rows split into two shards of odd, unequal widths (rows strided), each shard's statistics,
sums and gradient, combined as the vocabulary-parallel op's collectives combine them, against the
fp64 reference on the whole rows; a half gradient written into fp32 logits' own bytes; refused
inputs; and compiling for Hopper.

The op through them, on 2 gloo ranks, is tests/ops/distillation/test_vocab_parallel.py's.
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

shard_kernels = pytest.importorskip("liger_patch.ops.distillation.triton.shard_rows")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

ROWS, V, SPLIT = 6, 131, 70  # shards of 70 and 61 columns
OPTS = dict(temperature=1.8, ce_weight=0.4, student_softcap=5.0, teacher_softcap=7.0, student_logit_scale=1.2)


def _inputs(gen, device):
    """Student logits (bf16, rows strided by V + 5), teacher logits, labels with each shard's first
    and last column, and row coefficients, on ``device`` (drawn on the CPU)."""
    wide = torch.empty(ROWS, V + 5, dtype=torch.bfloat16, device=device)
    wide[:, :V] = torch.randn(ROWS, V, generator=gen) * 3
    xs = wide[:, :V]
    xt = torch.randn(ROWS, V, generator=gen) * 3
    labels = torch.randint(0, V, (ROWS,), generator=gen)
    labels[:4] = torch.tensor([0, SPLIT - 1, SPLIT, V - 1])
    coef = torch.rand(ROWS, generator=gen) + 0.5
    return xs, xt.to(device), labels.to(device), coef.to(device)


def _label_cols(labels, start, stop):
    return torch.where((labels >= start) & (labels < stop), labels - start, -1)


def _sharded(xs, xt, labels, coef, opts):
    """The loss and the gradient (fp32) from the two shards, combined as the op's collectives do."""
    shards = [(0, SPLIT), (SPLIT, V)]
    stats = torch.stack(
        [
            shard_kernels.shard_stats_triton(xs[:, a:b], xt[:, a:b], _label_cols(labels, a, b), opts)
            for a, b in shards
        ]
    )
    rows = {
        "lse_s": stats[:, 0].logsumexp(0),
        "lse_t": stats[:, 1].logsumexp(0),
        "lse_z": stats[:, 2].logsumexp(0),
    }
    sums = sum(
        shard_kernels.shard_sums_triton(xs[:, a:b], xt[:, a:b], rows["lse_s"], rows["lse_t"], opts)
        for a, b in shards
    )
    d = sums[0] if sums.shape[0] == 1 else opts.beta * sums[0] + (1 - opts.beta) * sums[1]
    ce = rows["lse_z"] - stats[:, 3].sum(0)
    loss = (1 - opts.ce_weight) * d + opts.ce_weight * ce
    grad = torch.full((ROWS, V), float("nan"), device=xs.device)
    for a, b in shards:
        cols = _label_cols(labels, a, b)
        shard_kernels.shard_grad_triton(
            xs[:, a:b], xt[:, a:b], grad[:, a:b], rows, sums[-1], cols, coef, opts
        )
    return loss, grad


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.37])
def test_two_shards_give_the_whole_rows(gen, device, beta):
    opts = build_distill_options(beta=beta, backend="triton", **OPTS)
    xs, xt, labels, coef = _inputs(gen, device)
    loss, grad = _sharded(xs, xt, labels, coef, opts)

    x = xs.double().requires_grad_()
    zs, zt = divergence_input(x, 1.2, 5.0), divergence_input(xt, None, 7.0)
    expected = reference_rows(zs, zt, labels, beta=beta, temperature=1.8, ce_weight=0.4)
    (expected_grad,) = torch.autograd.grad((expected * coef.double()).sum(), x)
    torch.testing.assert_close(loss.double(), expected, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-5, atol=1e-6)


def test_a_half_gradient_in_fp32_logits_bytes(gen, device):
    """fp32 logits (``logits_dtype=torch.float32``), the bf16 gradient written over their bytes
    (``gemm.grad_view``): the values of an fp32 gradient buffer of its own, rounded once (the
    interpreter narrows by truncation, the GPU to nearest: within one bf16 step)."""
    opts = build_distill_options(beta=0.37, backend="triton", **OPTS)
    xs, xt, labels, coef = _inputs(gen, device)
    xs = xs.float()
    stats = shard_kernels.shard_stats_triton(xs, xt, labels, opts)
    rows = {"lse_s": stats[0], "lse_t": stats[1], "lse_z": stats[2]}
    row_sum = shard_kernels.shard_sums_triton(xs, xt, rows["lse_s"], rows["lse_t"], opts)[-1]
    apart = torch.empty(ROWS, V, device=device)
    shard_kernels.shard_grad_triton(xs, xt, apart, rows, row_sum, labels, coef, opts)
    inside = grad_view(xs, torch.bfloat16)
    shard_kernels.shard_grad_triton(xs, xt, inside, rows, row_sum, labels, coef, opts)
    assert inside.data_ptr() == xs.data_ptr()
    torch.testing.assert_close(inside.float(), apart, rtol=2**-7, atol=1e-30)


def test_refused_inputs():
    opts = build_distill_options(beta=0.5, backend="triton")
    logits = torch.randn(3, 8)
    rows = {"lse_s": torch.zeros(3), "lse_t": torch.zeros(3)}
    with pytest.raises(ValueError, match="differ in shape"):
        shard_kernels.shard_stats_triton(logits, logits[:2], torch.zeros(3, dtype=torch.long), opts)
    with pytest.raises(ValueError, match="unit column stride"):
        shard_kernels.shard_sums_triton(
            logits.t().contiguous().t()[:, ::2], logits[:, :4], *rows.values(), opts
        )
    with pytest.raises(ValueError, match="view of their bytes"):
        grad = torch.empty(3, 8, dtype=torch.bfloat16)
        cols = torch.zeros(3, dtype=torch.long)
        shard_kernels.shard_grad_triton(logits, logits, grad, rows, torch.zeros(3), cols, torch.ones(3), opts)


# (kernel, BETA_MODE, HAS_CE, S_SOFTCAP, T_SOFTCAP, student, teacher, grad dtypes, GRAD_ALIASES_WIDER)
VARIANTS = [
    ("stats", 0, True, True, True, "*bf16", "*bf16", "*bf16", False),
    ("stats", 0, False, False, False, "*fp32", "*bf16", "*bf16", False),
    ("sums", 0, False, False, True, "*bf16", "*bf16", "*bf16", False),
    ("sums", 1, False, True, False, "*bf16", "*fp32", "*bf16", False),
    ("sums", 2, False, True, True, "*bf16", "*bf16", "*bf16", False),
    ("grad", 0, True, False, False, "*bf16", "*bf16", "*bf16", False),
    ("grad", 1, False, True, True, "*fp16", "*fp16", "*fp16", False),
    ("grad", 2, True, True, False, "*fp32", "*fp32", "*bf16", True),
]

COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from liger_patch.ops.distillation.triton import shard_rows as k
from liger_patch.ops.core.triton.common import sfu_log, softcap
from liger_patch.ops.distillation.triton.rows import final_block, launch_config, mixture_terms
from liger_patch.ops.core.tuning import Tuning

sides = {"s_scale": "fp32", "s_cap": "fp32", "t_scale": "fp32", "t_cap": "fp32"}
signatures = {
    "stats": (k._shard_stats_kernel, ["s_ptr", "t_ptr", "cols_ptr", "out_ptr"],
              dict(n_rows="i32", stride_s="i64", stride_t="i64", V="i32", **sides, temperature="fp32")),
    "sums": (k._shard_sums_kernel, ["s_ptr", "t_ptr", "lse_s_ptr", "lse_t_ptr", "out_ptr"],
             dict(n_rows="i32", stride_s="i64", stride_t="i64", V="i32", **sides, log_beta="fp32",
                  log_1m_beta="fp32", inv_beta="fp32", inv_1m_beta="fp32")),
    "grad": (k._shard_grad_kernel, ["s_ptr", "t_ptr", "grad_ptr", "lse_s_ptr", "lse_t_ptr", "lse_z_ptr",
                                    "row_sum_ptr", "cols_ptr", "coef_ptr"],
             dict(stride_s="i64", stride_t="i64", stride_grad="i64", V="i32", **sides, log_beta="fp32",
                  log_1m_beta="fp32", ce_weight="fp32", temperature="fp32")),
}
block, warps = launch_config(64128, Tuning(), interpret=False)
report = []
for kind, mode, ce, s_cap, t_cap, s_dtype, t_dtype, g_dtype, aliases in json.loads(sys.argv[1]):
    fn, pointers, scalars = signatures[kind]
    signature = {name: "*fp32" for name in pointers}
    signature.update(s_ptr=s_dtype, t_ptr=t_dtype, **scalars)
    if kind == "grad":
        signature.update(grad_ptr=g_dtype, cols_ptr="*i64")
    if kind == "stats":
        signature.update(cols_ptr="*i64")
    constexprs = dict(S_SOFTCAP=s_cap, T_SOFTCAP=t_cap, BLOCK_V=block, SOFTCAP_FN=triton.jit(softcap),
                      FINAL_FN=triton.jit(final_block))
    if kind == "stats":
        constexprs.update(HAS_CE=ce, ONLINE_FN=triton.jit(k._online), LSE_FN=triton.jit(k._lanes_lse))
    else:
        mix = mode == 2
        constexprs.update(BETA_MODE=mode, MIX_FN=triton.jit(mixture_terms) if mix else None,
                          LOG_FN=triton.jit(sfu_log) if mix else None)
    if kind == "grad":
        constexprs.update(HAS_CE=ce, GRAD_ALIASES_WIDER=aliases)
    order = [n for n in fn.__code__.co_varnames[: fn.__code__.co_argcount]]
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in order}
    src = ASTSource(fn=triton.jit(fn), signature=signature,
                    constexprs={(order.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    report.append(len(compiled.asm["cubin"]))
print(json.dumps(report))
"""


def test_kernels_compile_for_sm90():
    """Every branch of the three kernels compiles for Hopper with the launch of a 64128-column
    shard, in a fresh interpreter without TRITON_INTERPRET (see test_kernel_builds.py)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(VARIANTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(sizes) == len(VARIANTS) and all(size > 0 for size in sizes), sizes
