"""Triton row kernel: loss terms and d(loss)/d(logits) for one chunk of logits, in one launch.

Each program owns one row (token). Pass 1 streams the row once for an online log-sum-exp (and
the logit sum for label smoothing); pass 2 streams it again, backwards so that the part pass 1
read last is still in L2, and writes the gradient in place. Ignored rows skip both passes and only
write zeros. When the logits GEMM left log-sum-exp partials (``triton/logits.py``), folding them
replaces pass 1. All arithmetic is fp32. With the full rows' log-sum-exp given, the chunk may also be a
block of columns of wider rows (``col_offset``, ``V_total``): only pass 2 runs then.

The records of ``row_io`` switch on code through constexpr flags, so that the kernel compiled
without them is the one it was before: class weights (``HAS_CLASS_WEIGHT``), the per-row argmax,
entropy and token scale (``WANT_ARGMAX``, ``WANT_ENTROPY``, ``HAS_TOKEN_SCALING``; argmax and
entropy need lse, so pass 2 computes them, and runs for them without a gradient too) and the
entropy's gradient (``HAS_ENTROPY_GRAD``).

The kernel is compiled on first use, for the mode ``TRITON_INTERPRET`` names at that moment, so
the same process can run it on CUDA and, under the interpreter, on CPU tensors. Its launch
(block, warps, pass order) comes from the call's ``Tuning``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.triton.common import fold_partials, jitted, pow2_at_least, softcap
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import (
    NO_RECORDS,
    ChunkRecords,
    GivenLse,
    RowGrad,
    RowOutputs,
    check_records,
)


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
    cw_ptr,
    cw_total_ptr,
    argmax_ptr,
    entropy_ptr,
    token_scale_ptr,
    eg_coef_ptr,
    eg_entropy_ptr,
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
    HAS_CLASS_WEIGHT: tl.constexpr,
    WANT_ARGMAX: tl.constexpr,
    WANT_ENTROPY: tl.constexpr,
    HAS_TOKEN_SCALING: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    GRAD_ALIASES_WIDER: tl.constexpr,
    REVERSE_PASS2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
    FOLD_FN: tl.constexpr,
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
        if WANT_ARGMAX:
            tl.store(argmax_ptr + row, tl.full([], -1, dtype=tl.int64))
        if WANT_ENTROPY:
            tl.store(entropy_ptr + row, 0.0)
        if HAS_TOKEN_SCALING:
            tl.store(token_scale_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros([BLOCK_V], dtype=grad_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                cols = start + offsets
                tl.store(grad_row + cols, zeros, mask=cols < V)
    else:
        if HAS_LSE:
            lse = tl.load(lse_in_ptr + row)
        elif HAS_PARTIALS:
            # The logits GEMM left (max, sum exp, sum z) per vocabulary tile: fold them. (Their sum z
            # is unweighted: the host refuses them with class weights and label smoothing.)
            _row_max, lse, z_total = FOLD_FN(pmax_ptr, psum_ptr, pz_ptr, row, n_parts, BLOCK_P, HAS_SMOOTHING)
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
                if HAS_SMOOTHING and HAS_CLASS_WEIGHT:
                    # sum_j w_j z_j (pass 1 sees whole rows: col_offset is 0); w is 0 past the row
                    z_total += tl.sum(tl.load(cw_ptr + cols, mask=mask, other=0.0) * z, axis=0)
                z = tl.where(mask, z, float("-inf"))
                new_max = tl.maximum(run_max, tl.max(z, axis=0))
                run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(z - new_max), axis=0)
                run_max = new_max
                if HAS_SMOOTHING and not HAS_CLASS_WEIGHT:
                    z_total += tl.sum(tl.where(mask, z, 0.0), axis=0)
            lse = run_max + tl.log(run_sum)
        if not HAS_LSE:
            z_label = tl.load(logits_row + label).to(tl.float32)
            if HAS_SCALE:
                z_label = z_label * logit_scale
            if HAS_SOFTCAP:
                z_label, _ = SOFTCAP_FN(z_label, softcap)
            if HAS_CLASS_WEIGHT:
                # (1-e) w_y (lse - z_y) + e/V (W lse - sum_j w_j z_j)
                ce = tl.load(cw_ptr + label) * (lse - z_label)
                if HAS_SMOOTHING:
                    ce = (1.0 - smoothing) * ce + smoothing / V * (tl.load(cw_total_ptr) * lse - z_total)
            else:
                ce = lse - z_label
                if HAS_SMOOTHING:
                    ce = (1.0 - smoothing) * ce + smoothing * (lse - z_total / V)
            if HAS_TOKEN_SCALING:
                # p_y, detached: it scales the ce here and both gradient coefficients in pass 2
                token_scale = tl.exp(tl.minimum(z_label - lse, 0.0))
                ce = ce * token_scale
                tl.store(token_scale_ptr + row, token_scale)
            tl.store(ce_ptr + row, ce)
            tl.store(lse_ptr + row, lse)

        if COMPUTE_GRAD or WANT_ARGMAX or WANT_ENTROPY:
            if COMPUTE_GRAD:
                coef_ce = tl.load(coef_ce_ptr + row)
                coef_z = tl.load(coef_z_ptr + row)
                if HAS_TOKEN_SCALING:
                    # the whole row's loss is scaled (row_io.RowOutputs): both coefficients
                    coef_ce = coef_ce * token_scale
                    coef_z = coef_z * token_scale
                if HAS_CLASS_WEIGHT:
                    # d ce/dz = a p - (1-eps) w_y onehot - eps/V w ; a = (1-eps) w_y + eps/V W
                    w_label = tl.load(cw_ptr + label)  # the label's weight, in this block or not
                    a = (1.0 - smoothing) * w_label
                    if HAS_SMOOTHING:
                        a = a + smoothing / V_total * tl.load(cw_total_ptr)
                    coef_p = coef_ce * a + 2.0 * z_loss_scale * lse * coef_z
                    at_label = coef_ce * (1.0 - smoothing) * w_label
                else:
                    # d ce/dz = p - (1-eps) onehot - eps/V ; d(zs lse^2)/dz = 2 zs lse p
                    coef_p = coef_ce + 2.0 * z_loss_scale * lse * coef_z
                    at_label = coef_ce * (1.0 - smoothing)
                flat = coef_ce * smoothing / V_total  # times w_j with class weights
                if HAS_ENTROPY_GRAD:
                    # d H / dz_j = p_j (lse - z_j - H)
                    eg_coef = tl.load(eg_coef_ptr + row)
                    eg_shift = lse - tl.load(eg_entropy_ptr + row)
                label_col = label - col_offset  # this chunk may be a block of columns [col_offset, +V)
            # Argmax and entropy are kept per lane and reduced once after the loop: no reduction
            # across warps per block.
            if WANT_ARGMAX:
                best_z = tl.zeros([BLOCK_V], dtype=tl.float32) - float("inf")
                best_col = tl.zeros([BLOCK_V], dtype=tl.int32) + V
            if WANT_ENTROPY:
                entropy = tl.zeros([BLOCK_V], dtype=tl.float32)
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
                if WANT_ARGMAX:
                    # Per lane, the larger z or on a tie the smaller column (columns past the row
                    # are -inf and never taken), whichever way the blocks are walked.
                    z_cols = tl.where(mask, z, float("-inf"))
                    take = (z_cols > best_z) | ((z_cols == best_z) & (cols < best_col))
                    best_col = tl.where(take, cols, best_col)
                    best_z = tl.where(take, z_cols, best_z)
                if COMPUTE_GRAD or WANT_ENTROPY:
                    # p <= 1: where lse came from another GEMM (the forward's, or the fused one's
                    # partials) a logit may round above it, and exp of that can overflow.
                    p = tl.exp(tl.minimum(z - lse, 0.0))
                if WANT_ENTROPY:
                    entropy += tl.where(mask, p * (lse - z), 0.0)
                if COMPUTE_GRAD:
                    if HAS_CLASS_WEIGHT and HAS_SMOOTHING:
                        w = tl.load(cw_ptr + col_offset + cols, mask=mask, other=0.0)
                        g = coef_p * p - flat * w
                    else:
                        g = coef_p * p - flat
                    g = tl.where(cols == label_col, g - at_label, g)
                    if HAS_ENTROPY_GRAD:
                        g = g + eg_coef * p * (eg_shift - z)
                    if HAS_SOFTCAP:
                        g = g * d_softcap
                    if HAS_SCALE:
                        g = g * logit_scale
                    if GRAD_ALIASES_WIDER:
                        # The narrower gradient shares this row's bytes with the fp32 logits: block k's
                        # stores land on logits of blocks <= k, so every warp must have read block k first.
                        tl.debug_barrier()
                    tl.store(grad_row + cols, g.to(grad_ptr.dtype.element_ty), mask=mask)
            if WANT_ARGMAX:
                # the first column among the lanes that hold the row's largest z
                row_best = tl.where(best_z == tl.max(best_z, axis=0), best_col, V)
                tl.store(argmax_ptr + row, tl.min(row_best, axis=0).to(tl.int64))
            if WANT_ENTROPY:
                tl.store(entropy_ptr + row, tl.sum(entropy, axis=0))


def launch_config(vocab: int, tuning: Tuning, interpret: bool) -> tuple[int, int]:
    """``(block, warps)`` of the row kernel for rows of ``vocab`` logits."""
    if interpret:
        # Small blocks keep the interpreter fast and make small test vocabularies span several blocks.
        return min(64, max(16, pow2_at_least(vocab))), 1
    block = min(tuning.row_block, max(128, pow2_at_least(vocab)))
    return block, tuning.warps_for(block)


def ce_rows_triton(
    logits: torch.Tensor,
    labels: torch.Tensor,
    opts: LossOptions,
    *,
    grad: RowGrad | None = None,
    given: GivenLse | None = None,
    records: ChunkRecords = NO_RECORDS,
    partials: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Same contract as ``rows.ce_rows_torch`` (the records as ``row_io`` describes them); the
    launch follows ``opts.tuning``.

    With ``given`` (the rows' log-sum-exp, saved by the forward) pass 1 is skipped and
    ``(None, given.lse)`` is returned. With ``partials`` (``logits_with_partials``', for these
    logits) pass 1 is replaced by folding them, and ``(ce, lse)`` is returned as usual.
    ``grad.out`` may alias ``logits`` element for element (same dtype) or byte for byte with a
    narrower dtype (a view of the same storage with the same row start; ``gemm.grad_view``).
    Partials carry the unweighted sum of z, so they are refused with class weights and label
    smoothing together.
    """
    rows, vocab = logits.shape
    vocab_total = vocab if given is None else (given.vocab_total or vocab)
    check_records(records, given is not None, vocab_total)
    if partials is not None and records.class_weight is not None and opts.label_smoothing != 0.0:
        raise ValueError(
            "partials carry the unweighted sum of the logits: not with class weights and label smoothing"
        )
    if rows == 0:
        return logits.new_zeros(0), logits.new_zeros(0)
    _check_layout(logits, grad, given, partials, vocab_total)
    args = _KernelTensors.of(logits, labels, grad, given, records, partials)
    _launch(logits, args, opts, given)
    if records.outputs is not None:
        written = (args.argmax, args.entropy, args.token_scale)
        for mine, theirs in zip(records.outputs.tensors(), written, strict=True):
            if mine is not None and theirs is not mine:
                mine.copy_(theirs)
    return (None, args.lse_in) if given is not None else (args.ce, args.lse)


def _check_layout(
    logits: torch.Tensor,
    grad: RowGrad | None,
    given: GivenLse | None,
    partials: tuple | None,
    vocab_total: int,
) -> None:
    """Partials only for whole rows computed from scratch, unit column strides, and partials of
    one row per logits row."""
    rows, vocab = logits.shape
    if partials is not None and (given is not None or vocab_total != vocab):
        raise ValueError(
            "partials replace the log-sum-exp pass over whole rows: not with lse_in or a column block"
        )
    if logits.stride(1) != 1 or (grad is not None and grad.out.stride(1) != 1):
        raise ValueError("logits and grad must have unit column stride (rows may be strided)")
    pmax = None if partials is None else partials[0]
    if pmax is not None and (pmax.shape[0] != rows or not pmax.is_contiguous()):
        raise ValueError(f"partials must be contiguous ({rows}, tiles); got {tuple(pmax.shape)}")


@dataclass(frozen=True, slots=True)
class _KernelTensors:
    """The kernel's tensor arguments, each ``None`` where unused: the per-row vectors made
    contiguous (the kernel indexes them by row: strided or expanded views would be misread), the
    partials, the results it writes (ce and lse, the per-row outputs: ``_row_output``) and the
    records' tensors in fp32. ``grad`` is ``RowGrad.out``."""

    labels: torch.Tensor
    grad: torch.Tensor | None
    coef_ce: torch.Tensor | None
    coef_z: torch.Tensor | None
    lse_in: torch.Tensor | None
    partials: tuple
    ce: torch.Tensor | None
    lse: torch.Tensor | None
    cw: torch.Tensor | None
    cw_total: torch.Tensor | None
    argmax: torch.Tensor | None
    entropy: torch.Tensor | None
    token_scale: torch.Tensor | None
    eg_coef: torch.Tensor | None
    eg_entropy: torch.Tensor | None

    @classmethod
    def of(cls, logits, labels, grad, given, records, partials) -> _KernelTensors:  # noqa: PLR0913
        rows, device = logits.shape[0], logits.device
        labels = _contiguous(labels)
        coef_ce = coef_z = lse_in = None
        if grad is not None:
            coef_ce, coef_z = _contiguous(grad.coef_ce), _contiguous(grad.coef_z)
        if given is not None:
            lse_in = given.lse.contiguous()
        cw = cw_total = None
        if records.class_weight is not None:
            cw = records.class_weight.weight.contiguous()
            cw_total = records.class_weight.total.to(device=device, dtype=torch.float32).reshape(())
        out = records.outputs
        eg_coef = eg_entropy = None
        if records.entropy_grad is not None and grad is not None:  # without a gradient: nothing to add to
            eg_coef = records.entropy_grad.coef.to(torch.float32).contiguous()
            eg_entropy = records.entropy_grad.entropy.to(torch.float32).contiguous()
        new = given is None  # ce and lse are written unless the lse is given
        return cls(
            labels=labels,
            grad=None if grad is None else grad.out,
            coef_ce=coef_ce,
            coef_z=coef_z,
            lse_in=lse_in,
            partials=(None, None, None) if partials is None else tuple(partials),
            ce=torch.empty(rows, dtype=torch.float32, device=device) if new else None,
            lse=torch.empty(rows, dtype=torch.float32, device=device) if new else None,
            cw=cw,
            cw_total=cw_total,
            argmax=_row_output(out, "argmax", rows, torch.int64),
            entropy=_row_output(out, "entropy", rows, torch.float32),
            token_scale=_row_output(out, "token_scale", rows, torch.float32),
            eg_coef=eg_coef,
            eg_entropy=eg_entropy,
        )


def _launch(logits: torch.Tensor, t: _KernelTensors, opts: LossOptions, given: GivenLse | None) -> None:
    """One program per row of ``logits``, with the launch ``opts.tuning`` gives."""
    rows, vocab = logits.shape
    interpret = env.triton_interpret()  # read once for the launch: each read is host time
    block, warps = launch_config(vocab, opts.tuning, interpret)
    compute_grad = t.grad is not None
    pmax, psum, pz = t.partials
    n_parts = 0 if pmax is None else pmax.shape[1]
    grad_aliases_wider = (
        compute_grad
        and t.grad.element_size() < logits.element_size()
        and t.grad.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    )
    dummy = logits  # unused pointer arguments still need a tensor
    jitted(_ce_rows_kernel, interpret)[(rows,)](
        logits,
        dummy if t.grad is None else t.grad,
        dummy if t.labels is None else t.labels,
        dummy if t.coef_ce is None else t.coef_ce,
        dummy if t.coef_z is None else t.coef_z,
        dummy if t.lse_in is None else t.lse_in,
        dummy if pmax is None else pmax,
        dummy if psum is None else psum,
        dummy if pz is None else pz,
        n_parts,
        dummy if t.ce is None else t.ce,
        dummy if t.lse is None else t.lse,
        # None where unused: constexpr, no kernel parameter
        *(t.cw, t.cw_total, t.argmax, t.entropy, t.token_scale, t.eg_coef, t.eg_entropy),
        logits.stride(0),
        t.grad.stride(0) if compute_grad else 0,
        vocab,
        0 if given is None else given.col_offset,
        vocab if given is None else (given.vocab_total or vocab),
        opts.ignore_index,
        opts.scale,
        float(opts.softcap or 1.0),
        float(opts.label_smoothing),
        float(opts.z_loss_scale),
        HAS_SCALE=opts.logit_scale is not None,
        HAS_SOFTCAP=opts.softcap is not None,
        HAS_SMOOTHING=opts.label_smoothing != 0.0,
        HAS_LSE=given is not None,
        HAS_PARTIALS=pmax is not None,
        COMPUTE_GRAD=compute_grad,
        HAS_CLASS_WEIGHT=t.cw is not None,
        WANT_ARGMAX=t.argmax is not None,
        WANT_ENTROPY=t.entropy is not None,
        HAS_TOKEN_SCALING=t.token_scale is not None,
        HAS_ENTROPY_GRAD=t.eg_coef is not None,
        GRAD_ALIASES_WIDER=grad_aliases_wider,
        # In place over wider logits, block k's stores overwrite blocks <= k: forwards only.
        REVERSE_PASS2=opts.tuning.reverse_pass2 and not grad_aliases_wider,
        BLOCK_V=block,
        BLOCK_P=min(1024, pow2_at_least(max(n_parts, 1))),
        # A jitted function as a constexpr costs host time at every launch: passed only when used.
        SOFTCAP_FN=jitted(softcap, interpret) if opts.softcap is not None else None,
        FOLD_FN=jitted(fold_partials, interpret) if pmax is not None else None,
        num_warps=warps,
    )


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` contiguous (the kernel indexes per-row vectors by row), ``None`` as it is."""
    return None if t is None else t.contiguous()


def _row_output(outputs: RowOutputs | None, name: str, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Where the kernel writes the per-row output ``name``: the caller's tensor itself when it is
    a contiguous (rows,) tensor of ``dtype``, else a new one, copied into it after the launch."""
    t = None if outputs is None else getattr(outputs, name)
    if t is None:
        return None
    if tuple(t.shape) != (rows,):
        raise ValueError(f"outputs.{name} must have shape ({rows},), got {tuple(t.shape)}")
    if t.dtype == dtype and t.is_contiguous():
        return t
    return torch.empty(rows, dtype=dtype, device=t.device)
