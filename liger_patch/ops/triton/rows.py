"""Triton row kernel: loss terms and d(loss)/d(logits) for one chunk of logits, in one launch.

Each program owns one row (token). Pass 1 streams the row once for an online log-sum-exp (and
the logit sum for label smoothing); pass 2 streams it again, backwards so that the part pass 1
read last is still in L2, and writes the gradient in place. Ignored rows skip both passes and only
write zeros. When the logits GEMM left log-sum-exp partials (``triton/logits.py``), folding them
replaces pass 1. All arithmetic is fp32. With the full rows' log-sum-exp given, the chunk may also be a
block of columns of wider rows (``col_offset``, ``V_total``): only pass 2 runs then.

The kernel is compiled on first use, for the mode ``TRITON_INTERPRET`` names at that moment, so
the same process can run it on CUDA and, under the interpreter, on CPU tensors. Its launch
(block, warps, pass order) comes from the call's ``Tuning``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from liger_patch import env
from liger_patch.ops.options import LossOptions
from liger_patch.ops.triton.common import jitted, softcap
from liger_patch.ops.tuning import Tuning
from liger_patch.ops.validation import check_column_block


def _ce_rows_kernel(
    logits_ptr,
    grad_ptr,
    labels_ptr,
    coef_ce_ptr,
    coef_z_ptr,
    lse_in_ptr,
    pmax_ptr,
    psum_ptr,
    pz_ptr,
    n_parts,
    ce_ptr,
    lse_ptr,
    stride_logits,
    stride_grad,
    V,
    col_offset,
    V_total,
    ignore_index,
    logit_scale,
    softcap,
    smoothing,
    z_loss_scale,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_LSE: tl.constexpr,
    HAS_PARTIALS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    GRAD_ALIASES_WIDER: tl.constexpr,
    REVERSE_PASS2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels_ptr + row)
    logits_row = logits_ptr + row * stride_logits
    grad_row = grad_ptr + row * stride_grad
    offsets = tl.arange(0, BLOCK_V)

    if label == ignore_index:
        if not HAS_LSE:
            tl.store(ce_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                cols = start + offsets
                tl.store(grad_row + cols, zeros, mask=cols < V)
    else:
        if HAS_LSE:
            lse = tl.load(lse_in_ptr + row)
        elif HAS_PARTIALS:
            # The logits GEMM left (max, sum exp, sum z) per vocabulary tile: fold them.
            run_max = tl.zeros([], dtype=tl.float32) - float("inf")
            run_sum = tl.zeros([], dtype=tl.float32)
            z_total = tl.zeros([], dtype=tl.float32)
            part_offsets = tl.arange(0, BLOCK_P)
            for start in range(0, n_parts, BLOCK_P):
                idx = start + part_offsets
                mask = idx < n_parts
                p_max = tl.load(pmax_ptr + row * n_parts + idx, mask=mask, other=float("-inf"))
                p_sum = tl.load(psum_ptr + row * n_parts + idx, mask=mask, other=0.0)
                new_max = tl.maximum(run_max, tl.max(p_max, axis=0))
                rescaled = tl.sum(p_sum * tl.exp(p_max - new_max), axis=0)
                run_sum = run_sum * tl.exp(run_max - new_max) + rescaled
                run_max = new_max
                if HAS_SMOOTHING:
                    z_total += tl.sum(tl.load(pz_ptr + row * n_parts + idx, mask=mask, other=0.0), axis=0)
            lse = run_max + tl.log(run_sum)
        else:
            run_max = tl.zeros([], dtype=tl.float32) - float("inf")
            run_sum = tl.zeros([], dtype=tl.float32)
            z_total = tl.zeros([], dtype=tl.float32)
            for start in range(0, V, BLOCK_V):
                cols = start + offsets
                mask = cols < V
                z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_SCALE:
                    z = z * logit_scale
                if HAS_SOFTCAP:
                    z, _ = SOFTCAP_FN(z, softcap)
                z = tl.where(mask, z, float("-inf"))
                new_max = tl.maximum(run_max, tl.max(z, axis=0))
                run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
                run_max = new_max
                if HAS_SMOOTHING:
                    z_total += tl.sum(tl.where(mask, z, 0.0), axis=0)
            lse = run_max + tl.log(run_sum)
        if not HAS_LSE:
            z_label = tl.load(logits_row + label).to(tl.float32)
            if HAS_SCALE:
                z_label = z_label * logit_scale
            if HAS_SOFTCAP:
                z_label, _ = SOFTCAP_FN(z_label, softcap)
            ce = lse - z_label
            if HAS_SMOOTHING:
                ce = (1.0 - smoothing) * ce + smoothing * (lse - z_total / V)
            tl.store(ce_ptr + row, ce)
            tl.store(lse_ptr + row, lse)

        if COMPUTE_GRAD:
            coef_ce = tl.load(coef_ce_ptr + row)
            coef_z = tl.load(coef_z_ptr + row)
            # d ce/dz = p - (1-eps) onehot - eps/V ; d(zs lse^2)/dz = 2 zs lse p
            coef_p = coef_ce + 2.0 * z_loss_scale * lse * coef_z
            at_label = coef_ce * (1.0 - smoothing)
            flat = coef_ce * smoothing / V_total
            label_col = label - col_offset  # this chunk may be a block of columns [col_offset, +V)
            n_blocks = tl.cdiv(V, BLOCK_V)
            for i in range(0, n_blocks):
                # Backwards, the blocks pass 1 read last come first, while they are still in L2.
                start = (n_blocks - 1 - i) * BLOCK_V if REVERSE_PASS2 else i * BLOCK_V
                cols = start + offsets
                mask = cols < V
                z = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_SCALE:
                    z = z * logit_scale
                if HAS_SOFTCAP:
                    z, d_softcap = SOFTCAP_FN(z, softcap)
                # p <= 1: where lse came from another GEMM (the forward's, or the fused one's
                # partials) a logit may round above it, and exp of that can overflow.
                g = coef_p * tl.exp(tl.minimum(z - lse, 0.0)) - flat
                g = tl.where(cols == label_col, g - at_label, g)
                if HAS_SOFTCAP:
                    g = g * d_softcap
                if HAS_SCALE:
                    g = g * logit_scale
                if GRAD_ALIASES_WIDER:
                    # The narrower gradient shares this row's bytes with the fp32 logits: block k's
                    # stores land on logits of blocks <= k, so every warp must have read block k first.
                    tl.debug_barrier()
                tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)


def launch_config(vocab: int, tuning: Tuning, interpret: bool) -> tuple[int, int]:
    """``(block, warps)`` of the row kernel for rows of ``vocab`` logits."""
    if interpret:
        # Small blocks keep the interpreter fast and make small test vocabularies span several blocks.
        return min(64, max(16, triton.next_power_of_2(vocab))), 1
    block = min(tuning.row_block, max(128, triton.next_power_of_2(vocab)))
    return block, tuning.warps_for(block)


def ce_rows_triton(
    logits: torch.Tensor,
    labels: torch.Tensor,
    opts: LossOptions,
    grad: torch.Tensor | None = None,
    coef_ce: torch.Tensor | None = None,
    coef_z: torch.Tensor | None = None,
    lse_in: torch.Tensor | None = None,
    col_offset: int = 0,
    vocab_total: int | None = None,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Same contract as ``torch_ce.ce_rows_torch``; the launch follows ``opts.tuning``.

    With ``lse_in`` (saved by the forward) pass 1 is skipped and ``(None, lse_in)`` is returned.
    With ``partials`` (``triton.logits.logits_with_partials``'s, for these logits) pass 1 is
    replaced by folding them, and ``(ce, lse)`` is returned as usual.
    ``grad`` may alias ``logits`` element for element (same dtype) or byte for byte with a
    narrower dtype (a view of the same storage with the same row start); see ``chunked``.
    """
    rows, vocab = logits.shape
    check_column_block(vocab, col_offset, vocab_total, lse_in is not None)
    if rows == 0:
        return logits.new_zeros(0), logits.new_zeros(0)
    interpret = env.triton_interpret()
    block, warps = launch_config(vocab, opts.tuning, interpret)
    compute_grad = grad is not None
    has_lse = lse_in is not None
    if partials is not None and (has_lse or col_offset or (vocab_total or vocab) != vocab):
        raise ValueError(
            "partials replace the log-sum-exp pass over whole rows: not with lse_in or a column block"
        )
    if logits.stride(1) != 1 or (grad is not None and grad.stride(1) != 1):
        raise ValueError("logits and grad must have unit column stride (rows may be strided)")
    # The kernel indexes every per-row vector by row: strided or expanded views would be misread.
    labels, coef_ce, coef_z, lse_in = (
        None if t is None else t.contiguous() for t in (labels, coef_ce, coef_z, lse_in)
    )
    pmax, psum, pz = partials if partials is not None else (None, None, None)
    n_parts = 0 if pmax is None else pmax.shape[1]
    if pmax is not None and (pmax.shape[0] != rows or not pmax.is_contiguous()):
        raise ValueError(f"partials must be contiguous ({rows}, tiles); got {tuple(pmax.shape)}")
    ce = lse = None
    if not has_lse:
        ce = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grad_aliases_wider = (
        compute_grad
        and grad.element_size() < logits.element_size()
        and grad.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    )
    dummy = logits  # unused pointer arguments still need a tensor
    jitted(_ce_rows_kernel)[(rows,)](
        logits,
        grad if compute_grad else dummy,
        labels,
        coef_ce if compute_grad else dummy,
        coef_z if compute_grad else dummy,
        lse_in if has_lse else dummy,
        pmax if pmax is not None else dummy,
        psum if psum is not None else dummy,
        pz if pz is not None else dummy,
        n_parts,
        ce if ce is not None else dummy,
        lse if lse is not None else dummy,
        logits.stride(0),
        grad.stride(0) if compute_grad else 0,
        vocab,
        col_offset,
        vocab_total or vocab,
        opts.ignore_index,
        opts.scale,
        float(opts.softcap or 1.0),
        float(opts.label_smoothing),
        float(opts.z_loss_scale),
        HAS_SCALE=opts.logit_scale is not None,
        HAS_SOFTCAP=opts.softcap is not None,
        HAS_SMOOTHING=opts.label_smoothing != 0.0,
        HAS_LSE=has_lse,
        HAS_PARTIALS=pmax is not None,
        COMPUTE_GRAD=compute_grad,
        GRAD_ALIASES_WIDER=grad_aliases_wider,
        # In place over wider logits, block k's stores overwrite blocks <= k: forwards only.
        REVERSE_PASS2=opts.tuning.reverse_pass2 and not grad_aliases_wider,
        BLOCK_V=block,
        BLOCK_P=min(1024, triton.next_power_of_2(max(n_parts, 1))),
        SOFTCAP_FN=jitted(softcap),
        num_warps=warps,
    )
    return (None, lse_in) if has_lse else (ce, lse)
