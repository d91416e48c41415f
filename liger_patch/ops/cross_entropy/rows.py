"""Row kernel in plain PyTorch: the CPU default and the readable statement of the math.

It has the same contract as the Triton row kernel (``triton/rows.py``'s ``ce_rows_triton``): given one chunk
of logits ``x = W h + b`` it returns the per-row cross-entropy and log-sum-exp and, when
row coefficients are given, writes d(loss)/dx into ``grad``. The extra records (class weights,
per-row outputs, the entropy's gradient) are described in ``row_io``.

A row's loss from its statistics (:func:`row_loss`) is the one statement of the row math outside
the Triton kernel: the vocabulary-parallel loss runs it too, on statistics combined over shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_patch.ops.core.final_logits import final_logits, softcap_slope_, to_raw_logits_
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import (
    NO_RECORDS,
    ChunkRecords,
    ClassWeight,
    EntropyGrad,
    GivenLse,
    RowGrad,
    RowOutputs,
    check_records,
)


@dataclass(frozen=True)
class RowStats:
    """What a row's loss is made of, over all V columns of the row (z its final logits, w the
    class weights, 1 without): ``lse`` = logsumexp_j z_j, ``label_logit`` = z_y and, with label
    smoothing, ``logit_sum`` = sum_j w_j z_j (``None`` without). The row kernel forms them from
    whole rows; the vocabulary-parallel loss combines every shard's (``shard_stats.combine``)."""

    lse: torch.Tensor
    label_logit: torch.Tensor
    logit_sum: torch.Tensor | None = None


def _label_weight(
    class_weight: ClassWeight | None, labels: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor | None:
    """w_y per row (``None`` without class weights; any weight at ignored rows)."""
    return None if class_weight is None else class_weight.weight[torch.where(keep, labels, 0)]


def row_loss(
    stats: RowStats,
    labels: torch.Tensor,
    opts: LossOptions,
    class_weight: ClassWeight | None,
    vocab: int,
    *,
    token_scaling: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's cross-entropy from its statistics: the one statement of the row math, which
    the PyTorch row kernel and the vocabulary-parallel loss both run (docs/loss.md).

    ``ce = (1-e) w_y (lse - z_y) + e/V (lse sum_j w_j - sum_j w_j z_j)`` (e: label smoothing),
    times the token scale t = p_y = exp(z_y - lse) when ``token_scaling`` (the row kernels turn it
    on by their ``token_scale`` record, ``row_io``; the vocabulary-parallel loss by the option).
    Returns ``(ce, t)`` (``t`` is ``None`` without token scaling), both 0 at ignored rows. The
    z-loss term, ``z_loss_scale * lse^2`` times the same t, is formed by the caller from lse."""
    keep = labels != opts.ignore_index
    ce = stats.lse - stats.label_logit
    w_label = _label_weight(class_weight, labels, keep)
    if w_label is not None:
        ce = w_label * ce
    if opts.label_smoothing:
        eps = opts.label_smoothing
        total = vocab if class_weight is None else class_weight.total
        ce = (1.0 - eps) * ce + eps / vocab * (total * stats.lse - stats.logit_sum)
    zero = torch.zeros((), dtype=ce.dtype, device=ce.device)
    ce = torch.where(keep, ce, zero)
    if not token_scaling:
        return ce, None
    token_scale = torch.where(keep, torch.exp((stats.label_logit - stats.lse).clamp_max(0.0)), zero)
    return ce * token_scale, token_scale


def _row_stats(
    z: torch.Tensor, safe_labels: torch.Tensor, opts: LossOptions, class_weight: ClassWeight | None
) -> RowStats:
    """:class:`RowStats` of whole rows of final logits ``z``."""
    logit_sum = None
    if opts.label_smoothing:
        logit_sum = z.sum(dim=-1) if class_weight is None else z @ class_weight.weight
    return RowStats(torch.logsumexp(z, dim=-1), z.gather(-1, safe_labels).squeeze(-1), logit_sum)


def ce_rows_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    opts: LossOptions,
    *,
    grad: RowGrad | None = None,
    given: GivenLse | None = None,
    records: ChunkRecords = NO_RECORDS,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-row loss terms of a (rows, V) logits chunk (any float dtype; the math is fp32).

    Returns ``(ce, lse)``, both 0 at ignored rows. With ``grad``, writes into ``grad.out``
    ``coef_ce[i] * d ce_i / dx + coef_z[i] * d lse_i^2 * z_loss_scale / dx`` (+ the entropy's
    term with ``records.entropy_grad``).

    With ``given`` (the full rows' log-sum-exp) the chunk may be a block of columns of wider rows
    (``GivenLse``); only the gradient is computed then, and ``(None, given.lse)`` is returned, as
    the Triton kernel does. ``records.outputs`` (the forward's per-row results) needs whole rows
    and no ``given``.
    """
    col_offset, vocab_total, lse_in = (
        (0, None, None) if given is None else (given.col_offset, given.vocab_total, given.lse)
    )
    class_weight, outputs, entropy_grad = records.class_weight, records.outputs, records.entropy_grad
    coef_ce, coef_z = (None, None) if grad is None else (grad.coef_ce, grad.coef_z)
    vocab = logits.shape[-1]
    check_records(records, lse_in is not None, vocab_total or vocab)
    vocab_total = vocab_total or vocab
    keep = labels != opts.ignore_index
    local = labels - col_offset
    in_block = keep & (local >= 0) & (local < vocab)
    safe_labels = torch.where(in_block, local, 0).unsqueeze(-1)
    # w_y (1 without class weights): the label's weight, whether or not it is in this block
    w_label = _label_weight(class_weight, labels, keep)

    z, u = final_logits(logits, opts)
    ce = token_scale = None
    if lse_in is None:
        stats = _row_stats(z, safe_labels, opts, class_weight)
        scaling = outputs is not None and outputs.token_scale is not None
        ce, token_scale = row_loss(stats, labels, opts, class_weight, vocab, token_scaling=scaling)
        lse = stats.lse
    else:
        lse = torch.where(keep, lse_in, 0.0)

    if outputs is not None:
        _write_outputs(outputs, z, lse, keep)
    if token_scale is not None:
        outputs.token_scale.copy_(token_scale)
        coef_ce = None if coef_ce is None else coef_ce * token_scale
        coef_z = None if coef_z is None else coef_z * token_scale

    if grad is not None:
        block = _Block(z, u, lse, keep, in_block, safe_labels, w_label, col_offset, vocab_total, class_weight)
        grad.out.copy_(_grad(block, opts, coef_ce, coef_z, entropy_grad))

    if ce is None:
        return None, lse_in
    return ce, torch.where(keep, lse, torch.zeros((), dtype=lse.dtype, device=lse.device))


def _write_outputs(outputs: RowOutputs, z: torch.Tensor, lse: torch.Tensor, keep: torch.Tensor) -> None:
    """Fill the requested argmax and entropy rows (see ``RowOutputs``) for whole rows of ``z``
    (the token scale is ``row_loss``'s)."""
    if outputs.argmax is not None:
        outputs.argmax.copy_(torch.where(keep, z.argmax(dim=-1), -1))
    if outputs.entropy is not None:
        outputs.entropy.copy_(row_entropy(z, lse, keep))


def row_entropy(z: torch.Tensor, lse: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Each row's entropy of softmax(z), ``sum_j p_j (lse - z_j)`` with ``p = exp(z - lse)``, 0 at
    rows not kept; differentiable (the operator's second-order path takes its gradient)."""
    p = torch.exp((z - lse.unsqueeze(-1)).clamp_max(0.0))
    zero = torch.zeros((), dtype=torch.float32, device=z.device)
    return torch.where(keep, (p * (lse.unsqueeze(-1) - z)).sum(dim=-1), zero)


@dataclass(frozen=True)
class _Block:
    """A chunk's rows as the gradient needs them: z = softcap(s * x) and u = s * x / c (``None``
    without a softcap), the whole rows' log-sum-exp, the kept rows, the labels that fall in this
    block of columns (``in_block``) at their local column (``safe_labels``, (rows, 1)), the labels'
    class weights w_y (``None`` without class weights), and where the block sits in rows of
    ``vocab_total`` columns."""

    z: torch.Tensor
    u: torch.Tensor | None
    lse: torch.Tensor
    keep: torch.Tensor
    in_block: torch.Tensor
    safe_labels: torch.Tensor
    w_label: torch.Tensor | None
    col_offset: int
    vocab_total: int
    class_weight: ClassWeight | None


def _grad(
    block: _Block,
    opts: LossOptions,
    coef_ce: torch.Tensor,
    coef_z: torch.Tensor,
    entropy_grad: EntropyGrad | None,
) -> torch.Tensor:
    """d(loss)/dx of the chunk, 0 at ignored rows (the formulas are in docs/loss.md)."""
    z, lse, class_weight, vocab_total = block.z, block.lse, block.class_weight, block.vocab_total
    eps = opts.label_smoothing
    # d ce / dz = a p - (1-e) w_y onehot(y) - e/V w ;  a = (1-e) w_y + e/V sum(w)  (a = 1 when w = 1)
    # d (s lse^2) / dz = 2 s lse p
    w_y = 1.0 if block.w_label is None else block.w_label
    total = vocab_total if class_weight is None else class_weight.total
    a = (1.0 - eps) * w_y + eps / vocab_total * total
    coef_p = coef_ce * a + 2.0 * opts.z_loss_scale * lse * coef_z
    # p <= 1: with lse_in from another GEMM a logit may round above it (exp could overflow).
    p = torch.exp((z - lse.unsqueeze(-1)).clamp_max_(0.0))
    g = p * coef_p.unsqueeze(-1)
    at_label = torch.where(block.in_block, coef_ce * (1.0 - eps) * w_y, 0.0)
    g.scatter_add_(-1, block.safe_labels, -at_label.unsqueeze(-1))
    if eps:
        cols = slice(block.col_offset, block.col_offset + z.shape[-1])
        w_cols = 1.0 if class_weight is None else class_weight.weight[cols]
        g -= (coef_ce * (eps / vocab_total)).unsqueeze(-1) * w_cols
    if entropy_grad is not None:
        # d H / dz_j = p_j (sum_k p_k z_k - z_j) = p_j (lse - z_j - H)
        shift = (lse - entropy_grad.entropy).unsqueeze(-1)
        g += entropy_grad.coef.unsqueeze(-1) * p * (shift - z)
    slope = None if block.u is None else softcap_slope_(block.u)  # u is not read again
    return torch.where(block.keep.unsqueeze(-1), to_raw_logits_(g, slope, opts), 0.0)


def z_loss_rows(
    lse: torch.Tensor, opts: LossOptions, token_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``z_loss_scale * lse^2`` per row, times the row's ``token_scale`` when token scaling gives
    one (as the row kernels scale the cross-entropy); exactly 0 without z-loss (``0 * lse^2``
    would be NaN once lse^2 overflows fp32, at |lse| > 1.8e19, where the cross-entropy itself is
    finite)."""
    if opts.z_loss_scale == 0.0:
        return torch.zeros_like(lse)
    z_rows = opts.z_loss_scale * lse.square()
    return z_rows if token_scale is None else z_rows * token_scale
