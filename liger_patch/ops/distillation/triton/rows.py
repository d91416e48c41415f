"""Triton row kernel of the distillation loss: both sides' logits chunks in, each row's loss out,
and the student's gradient written in place over its logits, in one launch.

Each program owns one row (token). With x the raw logits (stored in the input dtype or fp32),
each side's a = softcap(s' x) has the temperature folded into s' and the cap
(``DistillOptions.student`` / ``.teacher``); ls = a_s - lse(a_s), lt = a_t - lse(a_t);
delta = ls - lt is formed as (a_s - a_t) - (lse_s - lse_t): where student and teacher nearly
agree the first difference is exact and only the row's constant carries rounding. The passes
over the row (docs/distillation.md counts their bytes):

* statistics: both sides' log-sum-exp from the fused GEMM's partials (``triton/logits.py``), or
  one online pass over both rows, which also gives each KL (the mean of a_s - a_t under the
  weights it already sums) and the student's log-sum-exp without temperature for the
  cross-entropy. Online per lane, one exp per logit and side (``e = exp(-|a - m|)``: the running
  sum is ``S e + 1`` when a is a new maximum, ``S + e`` otherwise); reduced across lanes once
  per row, so no barrier inside the loop. With the partials and the cross-entropy at T != 1
  (forward KL) this pass reads the student's row only.
* the mixture (0 < beta < 1) only: KL(p_s || m) and KL(p_t || m) need both log-sum-exps first
  and KL(p_s || m) comes before the gradient, so a pass of their sums.
* last: the gradient with respect to the student's raw logits, coef * d loss / d x, stored
  over the student's logits (or into a wider buffer, or as a half gradient into fp32 logits'
  own bytes); with the partials, forward KL's value.

Mixture terms from r = ls - log m with m = (1 - beta) p_s + beta p_t: with u = ls + log(1-beta),
v = lt + log beta and d = u - v, log m = max(u, v) + log(1 + exp(-|d|)): one exp of the larger
of u, v gives (1 - beta) p_s or beta p_t, the other is it times exp(-|d|); no overflow.

All arithmetic is fp32. Passes after the first alternate direction (``Tuning.reverse_pass2``),
so the blocks one pass read last are still in L2 when the next starts; except a last pass that
writes a narrower gradient into the logits' own bytes, which must walk forwards. Compiled on
first use for the ``TRITON_INTERPRET`` mode of that moment.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.triton.common import (
    fold_partials,
    jitted,
    per_element_log,
    pow2_at_least,
    softcap,
)
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.distillation.options import DistillOptions

Partials = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""((pmax, psum) of the student, (pmax, psum) of the teacher): ``logits_with_partials``' first two."""


def final_block(row_ptr, cols, mask, scale, cap, CAPPED: tl.constexpr, SOFTCAP_FN: tl.constexpr):
    """One side's final logits a = softcap(s' x) in fp32 at ``cols`` of its row (x as stored, 0
    where ``mask`` is off), and the softcap's slope (1.0 without one). The kernel takes it as the
    constexpr ``FINAL_FN=jitted(final_block)``."""
    a = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * scale
    slope = 1.0
    if CAPPED:
        a, slope = SOFTCAP_FN(a, cap)
    return a, slope


def mixture_terms(a_s, a_t, delta, lse_s, lse_t, kappa, log_beta, log_1m_beta, LOG_FN: tl.constexpr):
    """The mixture's terms at a block (the module doc's u, v and d = u - v): the larger of
    (1 - beta) p_s and beta p_t, e = exp(-|d|) (the smaller is their product), whether the
    student's is the larger, and r = log p_s - log m (log(1 + e) by ``LOG_FN``, the kernel's
    ``per_element_log()``). The kernel takes it as the constexpr ``MIX_FN=jitted(mixture_terms)``
    (for 0 < beta < 1 only)."""
    d_m = delta + kappa
    e_m = tl.exp(-tl.abs(d_m))
    s_larger = d_m >= 0.0
    # p <= 1: lse from the partials may sit a rounding below a logit
    larger = tl.exp(tl.minimum(tl.where(s_larger, a_s - lse_s + log_1m_beta, a_t - lse_t + log_beta), 0.0))
    r = tl.where(s_larger, -log_1m_beta, delta - log_beta) - LOG_FN(1.0 + e_m)
    return larger, e_m, s_larger, r


def _distill_rows_kernel(
    s_ptr,
    t_ptr,
    grad_ptr,
    labels_ptr,
    coef_ptr,
    loss_ptr,
    s_pmax_ptr,
    s_psum_ptr,
    t_pmax_ptr,
    t_psum_ptr,
    n_parts,
    stride_s,
    stride_t,
    stride_grad,
    V,
    ignore_index,
    s_scale,
    s_cap,
    t_scale,
    t_cap,
    log_beta,
    log_1m_beta,
    inv_1m_beta,
    ce_weight,
    temperature,
    BETA_MODE: tl.constexpr,  # 0: KL(p_t || p_s), 1: KL(p_s || p_t), 2: the mixture
    HAS_CE: tl.constexpr,
    CE_SCALED: tl.constexpr,  # the cross-entropy's log-sum-exp differs from the student's (T != 1)
    S_SOFTCAP: tl.constexpr,
    T_SOFTCAP: tl.constexpr,
    HAS_PARTIALS: tl.constexpr,
    STATS_PASS: tl.constexpr,  # a statistics pass runs (not everything came from the partials)
    LAST_D: tl.constexpr,  # forward KL's value is summed in the last pass (after the partials)
    COMPUTE_GRAD: tl.constexpr,
    GRAD_ALIASES_WIDER: tl.constexpr,  # a narrower gradient in the student's logits' bytes
    REVERSE_K: tl.constexpr,
    REVERSE_LAST: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
    FOLD_FN: tl.constexpr,
    FINAL_FN: tl.constexpr,
    MIX_FN: tl.constexpr,
    LOG_FN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    g_row = grad_ptr + row * stride_grad
    offsets = tl.arange(0, BLOCK_V)
    n_blocks = tl.cdiv(V, BLOCK_V)

    if label == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                cols = start + offsets
                tl.store(g_row + cols, zeros, mask=cols < V)
    else:
        # ---- statistics: lse_s, lse_t (and the KL for beta 0 / 1, lse_z for the cross-entropy)
        if HAS_PARTIALS:
            max_s, lse_s, _no_z = FOLD_FN(s_pmax_ptr, s_psum_ptr, s_pmax_ptr, row, n_parts, BLOCK_P, False)
            max_t, lse_t, _no_z = FOLD_FN(t_pmax_ptr, t_psum_ptr, t_pmax_ptr, row, n_parts, BLOCK_P, False)
        if STATS_PASS:
            m_s = tl.full([BLOCK_V], float("-inf"), tl.float32)
            m_t = tl.full([BLOCK_V], float("-inf"), tl.float32)
            sum_s = tl.zeros([BLOCK_V], dtype=tl.float32)
            sum_t = tl.zeros([BLOCK_V], dtype=tl.float32)
            sum_z = tl.zeros([BLOCK_V], dtype=tl.float32)
            w_d = tl.zeros([BLOCK_V], dtype=tl.float32)
            for i in range(0, n_blocks):
                cols = i * BLOCK_V + offsets
                mask = cols < V
                a_s, _ = FINAL_FN(s_row, cols, mask, s_scale, s_cap, S_SOFTCAP, SOFTCAP_FN)
                if HAS_PARTIALS:  # the cross-entropy's sum only, shifted by the known maximum
                    sum_z += tl.where(mask, tl.exp(temperature * (a_s - max_s)), 0.0)
                else:
                    a_t, _ = FINAL_FN(t_row, cols, mask, t_scale, t_cap, T_SOFTCAP, SOFTCAP_FN)
                    d_s = tl.where(mask, a_s - m_s, float("-inf"))
                    d_t = tl.where(mask, a_t - m_t, float("-inf"))
                    e_s = tl.exp(-tl.abs(d_s))
                    e_t = tl.exp(-tl.abs(d_t))
                    grow_s = d_s > 0.0
                    grow_t = d_t > 0.0
                    sum_s = tl.where(grow_s, sum_s * e_s + 1.0, sum_s + e_s)
                    sum_t = tl.where(grow_t, sum_t * e_t + 1.0, sum_t + e_t)
                    if BETA_MODE == 1:  # sum of p_s (a_s - a_t), weighted as sum_s
                        diff = tl.where(mask, a_s - a_t, 0.0)
                        w_d = tl.where(grow_s, w_d * e_s + diff, w_d + e_s * diff)
                    if BETA_MODE == 0:  # sum of p_t (a_t - a_s), weighted as sum_t
                        diff = tl.where(mask, a_t - a_s, 0.0)
                        w_d = tl.where(grow_t, w_d * e_t + diff, w_d + e_t * diff)
                    if CE_SCALED:  # z = T a_s: the same maximum, exp(-T |d|)
                        e_z = tl.exp(-temperature * tl.abs(d_s))
                        sum_z = tl.where(grow_s, sum_z * e_z + 1.0, sum_z + e_z)
                    m_s = tl.where(grow_s, a_s, m_s)
                    m_t = tl.where(grow_t, a_t, m_t)
            if HAS_PARTIALS:
                lse_z = temperature * max_s + tl.log(tl.sum(sum_z, axis=0))
            else:
                max_s = tl.max(m_s, axis=0)
                max_t = tl.max(m_t, axis=0)
                lane_s = tl.exp(m_s - max_s)  # 0 in lanes that saw no column
                lane_t = tl.exp(m_t - max_t)
                total_s = tl.sum(sum_s * lane_s, axis=0)
                total_t = tl.sum(sum_t * lane_t, axis=0)
                lse_s = max_s + tl.log(total_s)
                lse_t = max_t + tl.log(total_t)
                if BETA_MODE == 1:
                    div = tl.sum(w_d * lane_s, axis=0) / total_s - (lse_s - lse_t)
                if BETA_MODE == 0:
                    div = tl.sum(w_d * lane_t, axis=0) / total_t + (lse_s - lse_t)
                if CE_SCALED:
                    lane_z = tl.exp(temperature * (m_s - max_s))
                    lse_z = temperature * max_s + tl.log(tl.sum(sum_z * lane_z, axis=0))
        if HAS_CE and not CE_SCALED:
            lse_z = lse_s
        c = lse_s - lse_t
        kappa = log_1m_beta - log_beta

        # ---- the mixture's KL(p_s || m) and KL(p_t || m), as (1 - beta) KL_s and beta KL_t
        if BETA_MODE == 2:
            acc_s = tl.zeros([BLOCK_V], dtype=tl.float32)
            acc_t = tl.zeros([BLOCK_V], dtype=tl.float32)
            if HAS_PARTIALS and CE_SCALED:
                sum_z = tl.zeros([BLOCK_V], dtype=tl.float32)
            for i in range(0, n_blocks):
                start = (n_blocks - 1 - i) * BLOCK_V if REVERSE_K else i * BLOCK_V
                cols = start + offsets
                mask = cols < V
                a_s, _ = FINAL_FN(s_row, cols, mask, s_scale, s_cap, S_SOFTCAP, SOFTCAP_FN)
                a_t, _ = FINAL_FN(t_row, cols, mask, t_scale, t_cap, T_SOFTCAP, SOFTCAP_FN)
                delta = (a_s - a_t) - c
                larger, e_m, s_larger, r = MIX_FN(
                    a_s, a_t, delta, lse_s, lse_t, kappa, log_beta, log_1m_beta, LOG_FN
                )
                smaller = larger * e_m
                acc_s += tl.where(mask, tl.where(s_larger, larger, smaller) * r, 0.0)
                acc_t += tl.where(mask, tl.where(s_larger, smaller, larger) * (r - delta), 0.0)
                if HAS_PARTIALS and CE_SCALED:
                    sum_z += tl.where(mask, tl.exp(temperature * (a_s - max_s)), 0.0)
            kl_s_part = tl.sum(acc_s, axis=0)
            div = kl_s_part + tl.sum(acc_t, axis=0)
            kl_s = kl_s_part * inv_1m_beta
            if HAS_PARTIALS and CE_SCALED:
                lse_z = temperature * max_s + tl.log(tl.sum(sum_z, axis=0))

        if HAS_CE:  # before the last pass may overwrite the label's logit with its gradient
            a_y = tl.load(s_row + label).to(tl.float32) * s_scale
            if S_SOFTCAP:
                a_y, _label_slope = SOFTCAP_FN(a_y, s_cap)  # a scalar: not the loops' "_"
            ce = lse_z - temperature * a_y

        # ---- last: the gradient in place (and forward KL's value, after the partials)
        if COMPUTE_GRAD or LAST_D:
            if COMPUTE_GRAD:
                coef = tl.load(coef_ptr + row)
                c_div = coef * (1.0 - ce_weight)
                c_ce = coef * ce_weight * temperature
            acc_d = tl.zeros([BLOCK_V], dtype=tl.float32)
            for i in range(0, n_blocks):
                start = (n_blocks - 1 - i) * BLOCK_V if REVERSE_LAST else i * BLOCK_V
                cols = start + offsets
                mask = cols < V
                a_s, slope = FINAL_FN(s_row, cols, mask, s_scale, s_cap, S_SOFTCAP, SOFTCAP_FN)
                a_t, _ = FINAL_FN(t_row, cols, mask, t_scale, t_cap, T_SOFTCAP, SOFTCAP_FN)
                delta = (a_s - a_t) - c
                if BETA_MODE == 0:
                    p_s = tl.exp(tl.minimum(a_s - lse_s, 0.0))
                    p_t = tl.exp(tl.minimum(a_t - lse_t, 0.0))
                    g = p_s - p_t
                    if LAST_D:
                        acc_d += tl.where(mask, -p_t * delta, 0.0)
                elif BETA_MODE == 1:
                    p_s = tl.exp(tl.minimum(a_s - lse_s, 0.0))
                    g = p_s * (delta - div)
                else:
                    larger, e_m, s_larger, r = MIX_FN(
                        a_s, a_t, delta, lse_s, lse_t, kappa, log_beta, log_1m_beta, LOG_FN
                    )
                    scaled_ps = tl.where(s_larger, larger, larger * e_m)  # (1 - beta) p_s
                    g = scaled_ps * (r - kl_s)
                    p_s = scaled_ps * inv_1m_beta
                if COMPUTE_GRAD:
                    if HAS_CE:
                        p_z = tl.exp(tl.minimum(temperature * a_s - lse_z, 0.0)) if CE_SCALED else p_s
                        g = c_div * g + c_ce * p_z
                        g = tl.where(cols == label, g - c_ce, g)
                    else:
                        g = c_div * g
                    if S_SOFTCAP:
                        g = g * slope
                    g = g * s_scale
                    if GRAD_ALIASES_WIDER:
                        # Block k's stores land on the student's logits of blocks <= k (walked
                        # forwards): every warp must have read block k first.
                        tl.debug_barrier()
                    tl.store(g_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)
            if LAST_D:
                div = tl.sum(acc_d, axis=0)

        loss = (1.0 - ce_weight) * div + ce_weight * ce if HAS_CE else div
        tl.store(loss_ptr + row, loss)


def launch_config(vocab: int, tuning: Tuning, interpret: bool) -> tuple[int, int]:
    """``(block, warps)``: columns of each side per step, and warps per row. Two rows are read per
    step, so a block is half the cross-entropy kernel's ``row_block`` (the same bytes in flight,
    with its warps): 4096 x 16 warps at V=128256. Other shapes measured within 2 % (docs/perf-notes.md
    item 36)."""
    if interpret:
        # Small blocks keep the interpreter fast and make small test vocabularies span several blocks.
        return min(64, max(16, pow2_at_least(vocab))), 1
    block = min(max(tuning.row_block // 2, 64), max(128, pow2_at_least(vocab)))
    return block, tuning.warps_for(2 * block)


def _beta_mode(beta: float) -> int:
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def _aliases_wider(grad: torch.Tensor | None, student: torch.Tensor) -> bool:
    """Whether ``grad`` is narrower than the student's logits and lies in their bytes, row r
    starting where logits row r starts (``gemm.grad_view``)."""
    return (
        grad is not None
        and grad.element_size() < student.element_size()
        and grad.data_ptr() == student.data_ptr()
        and grad.stride(0) * grad.element_size() == student.stride(0) * student.element_size()
    )


def _fits(grad: torch.Tensor, student: torch.Tensor) -> bool:
    return grad.element_size() >= student.element_size() or _aliases_wider(grad, student)


def _check(student: torch.Tensor, teacher: torch.Tensor, grad: torch.Tensor | None, partials, beta: float):
    if teacher.shape != student.shape:
        shapes = f"{tuple(student.shape)} and {tuple(teacher.shape)}"
        raise ValueError(f"student and teacher logits differ in shape: {shapes}")
    for name, t in (("student logits", student), ("teacher logits", teacher), ("grad", grad)):
        if t is not None and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit column stride (rows may be strided)")
    if grad is not None and (grad.shape != student.shape or not _fits(grad, student)):
        raise ValueError(
            "grad must have the logits' shape and be at least as wide as the student's logits, or be a "
            "narrower view of their bytes whose rows start where theirs do"
        )
    if partials is None:
        return
    if beta == 1.0:
        raise ValueError("reverse KL (beta=1) gets its value from the online pass: no partials")
    shapes = {tuple(p.shape) for side in partials for p in side}
    if len(shapes) != 1 or next(iter(shapes))[0] != student.shape[0]:
        raise ValueError(f"partials must be (rows, tiles), one shape for both sides; got {sorted(shapes)}")
    if not all(p.is_contiguous() and p.dtype == torch.float32 for side in partials for p in side):
        raise ValueError("partials must be contiguous fp32")


def _scalars(opts: DistillOptions, mode: int) -> tuple:
    """The kernel's scalar arguments after the strides and V: the ignore index, each side's
    scale and cap (1.0 without one), the mixture's log beta, log(1 - beta) and 1 / (1 - beta)
    (0, 0, 1 outside it), the cross-entropy's weight and the temperature."""
    side_s, side_t, beta = opts.student, opts.teacher, opts.beta
    log_beta, log_1m_beta = (math.log(beta), math.log1p(-beta)) if mode == 2 else (0.0, 0.0)
    return (
        opts.ignore_index,
        side_s.scale,
        float(side_s.softcap or 1.0),
        side_t.scale,
        float(side_t.softcap or 1.0),
        log_beta,
        log_1m_beta,
        1.0 / (1.0 - beta) if mode == 2 else 1.0,
        opts.ce_weight,
        opts.temperature,
    )


def _pass_flags(
    opts: DistillOptions, mode: int, has_partials: bool, compute_grad: bool, aliases_wider: bool
) -> dict:
    """The kernel's constexprs that pick its terms and passes. The passes that run, in order:
    statistics (unless the partials give all it would), the mixture's, the last. After the
    first, each walks the other way (when the tuning reverses)."""
    has_ce = opts.ce_weight != 0.0
    ce_scaled = has_ce and opts.temperature != 1.0
    stats_pass = (not has_partials) or (ce_scaled and mode != 2)
    k_index, last_index = int(stats_pass), int(stats_pass) + int(mode == 2)
    reverse = opts.student.tuning.reverse_pass2
    return dict(
        BETA_MODE=mode,
        HAS_CE=has_ce,
        CE_SCALED=ce_scaled,
        S_SOFTCAP=opts.student.softcap is not None,
        T_SOFTCAP=opts.teacher.softcap is not None,
        HAS_PARTIALS=has_partials,
        STATS_PASS=stats_pass,
        LAST_D=mode == 0 and has_partials,
        COMPUTE_GRAD=compute_grad,
        GRAD_ALIASES_WIDER=aliases_wider,
        REVERSE_K=reverse and k_index % 2 == 1,
        # Over wider logits, block k's stores overwrite blocks <= k: forwards only.
        REVERSE_LAST=reverse and last_index % 2 == 1 and not aliases_wider,
    )


def _functions(opts: DistillOptions, mode: int, has_partials: bool) -> dict:
    """The jitted helpers the kernel takes as constexprs. A jitted function as a constexpr costs
    host time at every launch: passed only when used."""
    capped = opts.student.softcap is not None or opts.teacher.softcap is not None
    return dict(
        SOFTCAP_FN=jitted(softcap) if capped else None,
        FOLD_FN=jitted(fold_partials) if has_partials else None,
        FINAL_FN=jitted(final_block),
        MIX_FN=jitted(mixture_terms) if mode == 2 else None,
        LOG_FN=per_element_log() if mode == 2 else None,
    )


def distill_rows_triton(
    student: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    opts: DistillOptions,
    *,
    grad: torch.Tensor | None = None,
    coef: torch.Tensor | None = None,
    partials: Partials | None = None,
) -> torch.Tensor:
    """Each row's loss (rows,) fp32 from the raw logits chunks ``student`` and ``teacher``
    (rows, V; any float dtypes, unit column stride), labels (rows,) (``opts.ignore_index``: loss 0
    and a zero gradient); with ``grad`` and ``coef`` (rows,) fp32, writes ``coef_i * d loss_i /
    d x_s`` into ``grad``, which may be ``student`` itself (element for element), a wider
    buffer, or a narrower view of the student's bytes (``gemm.grad_view``: a half gradient over
    fp32 logits; the last pass then walks forwards). ``partials`` (``Partials``, for these
    logits under ``opts.student`` / ``.teacher``) replace the statistics pass. The launch
    follows ``opts.student.tuning``."""
    rows, vocab = student.shape
    _check(student, teacher, grad, partials, opts.beta)
    loss = torch.empty(rows, dtype=torch.float32, device=student.device)
    if rows == 0:
        return loss
    compute_grad = grad is not None and coef is not None
    aliases_wider = compute_grad and _aliases_wider(grad, student)
    block, warps = launch_config(vocab, opts.student.tuning, env.triton_interpret())
    mode = _beta_mode(opts.beta)
    has_partials = partials is not None
    (s_pmax, s_psum), (t_pmax, t_psum) = partials if has_partials else ((loss, loss), (loss, loss))
    n_parts = s_pmax.shape[1] if has_partials else 0
    labels = labels.contiguous()
    coef = coef.float().contiguous() if compute_grad else loss
    jitted(_distill_rows_kernel)[(rows,)](
        student,
        teacher,
        grad if compute_grad else student,
        labels,
        coef,
        loss,
        s_pmax,
        s_psum,
        t_pmax,
        t_psum,
        n_parts,
        student.stride(0),
        teacher.stride(0),
        grad.stride(0) if compute_grad else 0,
        vocab,
        *_scalars(opts, mode),
        **_pass_flags(opts, mode, has_partials, compute_grad, aliases_wider),
        BLOCK_V=block,
        BLOCK_P=min(1024, pow2_at_least(max(n_parts, 1))),
        **_functions(opts, mode, has_partials),
        num_warps=warps,
    )
    return loss
