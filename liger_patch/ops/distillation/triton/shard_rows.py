"""Triton row kernels of the distillation loss on a vocabulary shard (tensor parallelism): the
row math of ``distillation_rows``' shard functions over both sides' logits chunks as stored, in
three launches with the group's collectives between them (``distillation_vocab_parallel``):

* ``shard_stats_triton``: per row over the shard's columns, both sides' log-sum-exp of a (and
  with a cross-entropy term the log-sum-exp of z = T a_s and z at the label when it is here);
* ``shard_sums_triton``: with the whole rows' log-sum-exps, the shard's part of the divergence
  sums: [D] for beta 0 or 1, [KL(p_t || m), KL(p_s || m)] otherwise;
* ``shard_grad_triton``: with the rows' sums, ``coef * d loss / d x_s`` over the shard's columns,
  written over the student's logits (or into a narrower view of their bytes, or a wider buffer,
  as ``gemm.grad_view`` gives).

Each program owns one row; all arithmetic is fp32; a side's final logits and the mixture's terms
come from ``triton/distill.py``'s ``final_block`` and ``mixture_terms``, so the shard's terms are
the whole op's, term for term. The statistics pass is online per lane (``e = exp(-|a - m|)``, as
the whole op's statistics pass).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.triton.common import jitted, per_element_log, softcap
from liger_patch.ops.distillation.options import DistillOptions
from liger_patch.ops.distillation.triton.rows import final_block, launch_config, mixture_terms


def _online(sum_, m, a, mask):
    """One step of a per-lane online log-sum-exp: the new (sum, max) after the values ``a``."""
    d = tl.where(mask, a - m, float("-inf"))
    e = tl.exp(-tl.abs(d))
    grow = d > 0.0
    return tl.where(grow, sum_ * e + 1.0, sum_ + e), tl.where(grow, a, m)


def _lanes_lse(sum_, m):
    """The log-sum-exp of a row from its lanes' online (sum, max); -inf for no column."""
    top = tl.max(m, axis=0)
    return top + tl.log(tl.sum(sum_ * tl.exp(m - top), axis=0))


def _shard_stats_kernel(
    s_ptr,
    t_ptr,
    cols_ptr,
    out_ptr,
    n_rows,
    stride_s,
    stride_t,
    V,
    s_scale,
    s_cap,
    t_scale,
    t_cap,
    temperature,
    HAS_CE: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
    FINAL_FN: tl.constexpr,
    ONLINE_FN: tl.constexpr,
    LSE_FN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    offsets = tl.arange(0, BLOCK_V)
    m_s = tl.full([BLOCK_V], float("-inf"), tl.float32)
    m_t = tl.full([BLOCK_V], float("-inf"), tl.float32)
    m_z = tl.full([BLOCK_V], float("-inf"), tl.float32)
    sum_s = tl.zeros([BLOCK_V], dtype=tl.float32)
    sum_t = tl.zeros([BLOCK_V], dtype=tl.float32)
    sum_z = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offsets
        mask = cols < V
        a_s, _ = FINAL_FN(s_row, cols, mask, s_scale, s_cap, S_SOFTCAP, SOFTCAP_FN)
        a_t, _ = FINAL_FN(t_row, cols, mask, t_scale, t_cap, T_SOFTCAP, SOFTCAP_FN)
        sum_s, m_s = ONLINE_FN(sum_s, m_s, a_s, mask)
        sum_t, m_t = ONLINE_FN(sum_t, m_t, a_t, mask)
        if HAS_CE:
            sum_z, m_z = ONLINE_FN(sum_z, m_z, temperature * a_s, mask)
    tl.store(out_ptr + row, LSE_FN(sum_s, m_s))
    tl.store(out_ptr + n_rows + row, LSE_FN(sum_t, m_t))
    if HAS_CE:
        tl.store(out_ptr + 2 * n_rows + row, LSE_FN(sum_z, m_z))
        col = tl.load(cols_ptr + row)
        z_y = 0.0
        if col >= 0:
            a_y = tl.load(s_row + col).to(tl.float32) * s_scale
            if S_SOFTCAP:
                a_y, _label_slope = SOFTCAP_FN(a_y, s_cap)
            z_y = temperature * a_y
        tl.store(out_ptr + 3 * n_rows + row, z_y)


def _shard_sums_kernel(
    s_ptr,
    t_ptr,
    lse_s_ptr,
    lse_t_ptr,
    out_ptr,
    n_rows,
    stride_s,
    stride_t,
    V,
    s_scale,
    s_cap,
    t_scale,
    t_cap,
    log_beta,
    log_1m_beta,
    inv_beta,
    inv_1m_beta,
    BETA_MODE: tl.constexpr,  # 0: KL(p_t || p_s), 1: KL(p_s || p_t), 2: the mixture
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
    FINAL_FN: tl.constexpr,
    MIX_FN: tl.constexpr,
    LOG_FN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    c = lse_s - lse_t
    kappa = log_1m_beta - log_beta
    offsets = tl.arange(0, BLOCK_V)
    acc_a = tl.zeros([BLOCK_V], dtype=tl.float32)  # D, or (1 - beta) KL(p_s || m)
    acc_b = tl.zeros([BLOCK_V], dtype=tl.float32)  # beta KL(p_t || m)
    for start in range(0, V, BLOCK_V):
        cols = start + offsets
        mask = cols < V
        a_s, _ = FINAL_FN(s_row, cols, mask, s_scale, s_cap, S_SOFTCAP, SOFTCAP_FN)
        a_t, _ = FINAL_FN(t_row, cols, mask, t_scale, t_cap, T_SOFTCAP, SOFTCAP_FN)
        delta = (a_s - a_t) - c  # log p_s - log p_t
        if BETA_MODE == 0:
            acc_a += tl.where(mask, -tl.exp(tl.minimum(a_t - lse_t, 0.0)) * delta, 0.0)
        elif BETA_MODE == 1:
            acc_a += tl.where(mask, tl.exp(tl.minimum(a_s - lse_s, 0.0)) * delta, 0.0)
        else:
            larger, e_m, s_larger, r = MIX_FN(
                a_s, a_t, delta, lse_s, lse_t, kappa, log_beta, log_1m_beta, LOG_FN
            )
            smaller = larger * e_m
            acc_a += tl.where(mask, tl.where(s_larger, larger, smaller) * r, 0.0)
            acc_b += tl.where(mask, tl.where(s_larger, smaller, larger) * (r - delta), 0.0)
    if BETA_MODE == 2:  # the rows of shard_divergence_parts: [KL(p_t || m), KL(p_s || m)]
        tl.store(out_ptr + row, tl.sum(acc_b, axis=0) * inv_beta)
        tl.store(out_ptr + n_rows + row, tl.sum(acc_a, axis=0) * inv_1m_beta)
    else:
        tl.store(out_ptr + row, tl.sum(acc_a, axis=0))


def _shard_grad_kernel(
    s_ptr,
    t_ptr,
    grad_ptr,
    lse_s_ptr,
    lse_t_ptr,
    lse_z_ptr,
    row_sum_ptr,
    cols_ptr,
    coef_ptr,
    stride_s,
    stride_t,
    stride_grad,
    V,
    s_scale,
    s_cap,
    t_scale,
    t_cap,
    log_beta,
    log_1m_beta,
    ce_weight,
    temperature,
    BETA_MODE: tl.constexpr,
    HAS_CE: tl.constexpr,
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
    GRAD_ALIASES_WIDER: tl.constexpr,  # a narrower gradient in the student's logits' bytes
    BLOCK_V: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
    FINAL_FN: tl.constexpr,
    MIX_FN: tl.constexpr,
    LOG_FN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_grad
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    row_sum = tl.load(row_sum_ptr + row)  # D (beta 1) or KL(p_s || m) over every shard
    coef = tl.load(coef_ptr + row)
    c_div = coef * (1.0 - ce_weight)
    c = lse_s - lse_t
    kappa = log_1m_beta - log_beta
    if HAS_CE:
        lse_z = tl.load(lse_z_ptr + row)
        label_col = tl.load(cols_ptr + row)
        c_ce = coef * ce_weight * temperature
    offsets = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):  # forwards: a narrower gradient lands on blocks <= this one
        cols = start + offsets
        mask = cols < V
        a_s, slope = FINAL_FN(s_row, cols, mask, s_scale, s_cap, S_SOFTCAP, SOFTCAP_FN)
        a_t, _ = FINAL_FN(t_row, cols, mask, t_scale, t_cap, T_SOFTCAP, SOFTCAP_FN)
        delta = (a_s - a_t) - c
        if BETA_MODE == 0:
            g = tl.exp(tl.minimum(a_s - lse_s, 0.0)) - tl.exp(tl.minimum(a_t - lse_t, 0.0))
        elif BETA_MODE == 1:
            g = tl.exp(tl.minimum(a_s - lse_s, 0.0)) * (delta - row_sum)
        else:
            larger, e_m, s_larger, r = MIX_FN(
                a_s, a_t, delta, lse_s, lse_t, kappa, log_beta, log_1m_beta, LOG_FN
            )
            g = tl.where(s_larger, larger, larger * e_m) * (r - row_sum)  # (1 - beta) p_s (...)
        g = c_div * g
        if HAS_CE:
            g += c_ce * tl.exp(tl.minimum(temperature * a_s - lse_z, 0.0))
            g = tl.where(cols == label_col, g - c_ce, g)
        if S_SOFTCAP:
            g = g * slope
        g = g * s_scale
        if GRAD_ALIASES_WIDER:
            tl.debug_barrier()  # every warp has read this block before any store into its bytes
        tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


def _common(student: torch.Tensor, teacher: torch.Tensor, opts: DistillOptions) -> tuple:
    """The launch's block and warps, and both sides' (scale, cap) as the kernels take them."""
    if teacher.shape != student.shape:
        raise ValueError(
            f"student and teacher logits differ in shape: {tuple(student.shape)}, {tuple(teacher.shape)}"
        )
    for name, t in (("student logits", student), ("teacher logits", teacher)):
        if t.stride(1) != 1:
            raise ValueError(f"{name} must have unit column stride (rows may be strided)")
    block, warps = launch_config(student.shape[1], opts.student.tuning, env.triton_interpret())
    s, t = opts.student, opts.teacher
    sides = (s.scale, float(s.softcap or 1.0), t.scale, float(t.softcap or 1.0))
    return block, warps, sides


def _beta_terms(beta: float) -> tuple[int, float, float]:
    """(mode, log beta, log(1 - beta)): mode 0 forward KL, 1 reverse KL, 2 the mixture."""
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    return mode, *((math.log(beta), math.log1p(-beta)) if mode == 2 else (0.0, 0.0))


def _fns(opts: DistillOptions, mix: bool = False) -> dict:
    capped = opts.student.softcap is not None or opts.teacher.softcap is not None
    fns = dict(
        S_SOFTCAP=opts.student.softcap is not None,
        T_SOFTCAP=opts.teacher.softcap is not None,
        SOFTCAP_FN=jitted(softcap) if capped else None,
        FINAL_FN=jitted(final_block),
    )
    if mix:
        mixture = opts.beta not in (0.0, 1.0)
        fns["MIX_FN"] = jitted(mixture_terms) if mixture else None
        fns["LOG_FN"] = per_element_log() if mixture else None
    return fns


def shard_stats_triton(
    student: torch.Tensor, teacher: torch.Tensor, label_cols: torch.Tensor, opts: DistillOptions
) -> torch.Tensor:
    """(k, rows) fp32: per row over these columns, the log-sum-exp of the student's and the
    teacher's a, and with a cross-entropy term the log-sum-exp of z = T a_s and z at the label (0
    where ``label_cols`` is -1): ``distillation_rows.shard_stats``' values, from the raw logits
    chunks (rows, V_r) as stored."""
    rows, vocab = student.shape
    block, warps, sides = _common(student, teacher, opts)
    has_ce = opts.ce_weight != 0.0
    out = torch.empty(4 if has_ce else 2, rows, dtype=torch.float32, device=student.device)
    if rows:
        jitted(_shard_stats_kernel)[(rows,)](
            student, teacher, label_cols.contiguous(), out, rows, student.stride(0), teacher.stride(0),
            vocab, *sides, opts.temperature, HAS_CE=has_ce, BLOCK_V=block, **_fns(opts),
            ONLINE_FN=jitted(_online), LSE_FN=jitted(_lanes_lse), num_warps=warps,
        )  # fmt: skip
    return out


def shard_sums_triton(
    student: torch.Tensor,
    teacher: torch.Tensor,
    lse_s: torch.Tensor,
    lse_t: torch.Tensor,
    opts: DistillOptions,
) -> torch.Tensor:
    """(k, rows) fp32: the shard's part of the rows' divergence sums
    (``distillation_rows.shard_divergence_parts``' first value) from the raw logits chunks and the
    whole rows' log-sum-exps ``lse_s``, ``lse_t`` (rows,) fp32."""
    rows, vocab = student.shape
    block, warps, sides = _common(student, teacher, opts)
    mode, log_beta, log_1m_beta = _beta_terms(opts.beta)
    out = torch.empty(2 if mode == 2 else 1, rows, dtype=torch.float32, device=student.device)
    if rows:
        beta = opts.beta
        inverses = (1.0 / beta, 1.0 / (1.0 - beta)) if mode == 2 else (1.0, 1.0)
        jitted(_shard_sums_kernel)[(rows,)](
            student, teacher, lse_s.contiguous(), lse_t.contiguous(), out, rows, student.stride(0),
            teacher.stride(0), vocab, *sides, log_beta, log_1m_beta, *inverses, BETA_MODE=mode,
            BLOCK_V=block, **_fns(opts, mix=True), num_warps=warps,
        )  # fmt: skip
    return out


def shard_grad_triton(
    student: torch.Tensor,
    teacher: torch.Tensor,
    grad: torch.Tensor,
    stats: dict[str, torch.Tensor],
    row_sum: torch.Tensor,
    label_cols: torch.Tensor,
    coef: torch.Tensor,
    opts: DistillOptions,
) -> None:
    """Writes ``coef_i * d loss_i / d x_s`` over these columns into ``grad`` (the student's logits
    themselves, a narrower view of their bytes whose rows start where theirs do, or a wider
    buffer: ``gemm.grad_view``). ``stats``: the whole rows' ``lse_s``, ``lse_t`` and with a
    cross-entropy term ``lse_z`` (rows,) fp32; ``row_sum`` the last row of the rows' divergence
    sums over every shard; ``label_cols`` the label's column here or -1; ``coef`` (rows,) fp32."""
    rows, vocab = student.shape
    block, warps, sides = _common(student, teacher, opts)
    if grad.shape != student.shape or grad.stride(1) != 1:
        raise ValueError("grad must have the logits' shape and unit column stride")
    if not rows:
        return
    mode, log_beta, log_1m_beta = _beta_terms(opts.beta)
    has_ce = opts.ce_weight != 0.0
    narrower = grad.element_size() < student.element_size()
    same_rows = grad.stride(0) * grad.element_size() == student.stride(0) * student.element_size()
    if narrower and (grad.data_ptr() != student.data_ptr() or not same_rows):
        raise ValueError(
            "a gradient narrower than the logits must be a view of their bytes, rows starting where theirs do"
        )
    lse_z = stats["lse_z"] if has_ce else stats["lse_s"]
    jitted(_shard_grad_kernel)[(rows,)](
        student, teacher, grad, stats["lse_s"].contiguous(), stats["lse_t"].contiguous(),
        lse_z.contiguous(), row_sum.contiguous(), label_cols.contiguous(), coef.float().contiguous(),
        student.stride(0), teacher.stride(0), grad.stride(0), vocab, *sides, log_beta, log_1m_beta,
        opts.ce_weight, opts.temperature,
        BETA_MODE=mode, HAS_CE=has_ce, GRAD_ALIASES_WIDER=narrower, BLOCK_V=block,
        **_fns(opts, mix=True), num_warps=warps,
    )  # fmt: skip
