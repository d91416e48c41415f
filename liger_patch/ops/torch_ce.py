"""Row kernel in plain PyTorch: the CPU default and the readable statement of the math.

It has the same contract as the Triton row kernel (``triton/rows.py``'s ``ce_rows_triton``): given one chunk
of logits ``x = W h + b`` it returns the per-row cross-entropy and log-sum-exp and, when
row coefficients are given, writes d(loss)/dx into ``grad``.
"""

from __future__ import annotations

import torch

from liger_patch.ops.options import LossOptions
from liger_patch.ops.validation import check_column_block


def ce_rows_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    opts: LossOptions,
    grad: torch.Tensor | None = None,
    coef_ce: torch.Tensor | None = None,
    coef_z: torch.Tensor | None = None,
    lse_in: torch.Tensor | None = None,
    col_offset: int = 0,
    vocab_total: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Per-row loss terms of a (rows, V) logits chunk (any float dtype; the math is fp32).

    Returns ``(ce, lse)``, both 0 at ignored rows. With ``grad`` given, writes
    ``coef_ce[i] * d ce_i / dx + coef_z[i] * d lse_i^2 * z_loss_scale / dx`` into it (any dtype;
    it may alias ``logits``).

    With ``lse_in`` (the full rows' log-sum-exp) the chunk may be a block of columns
    ``[col_offset, col_offset + V)`` of rows of ``vocab_total`` logits; only the gradient is
    computed then, and ``(None, lse_in)`` is returned, as the Triton kernel does.
    """
    vocab = logits.shape[-1]
    check_column_block(vocab, col_offset, vocab_total, lse_in is not None)
    vocab_total = vocab_total or vocab
    keep = labels != opts.ignore_index
    local = labels - col_offset
    in_block = keep & (local >= 0) & (local < vocab)
    safe_labels = torch.where(in_block, local, 0).unsqueeze(-1)

    x = logits.float()
    if opts.logit_scale is not None:
        x = x * opts.scale
    u = None if opts.softcap is None else x / opts.softcap
    z = x if u is None else opts.softcap * torch.tanh(u)
    if lse_in is None:
        lse = torch.logsumexp(z, dim=-1)
        ce = lse - z.gather(-1, safe_labels).squeeze(-1)
        if opts.label_smoothing:
            eps = opts.label_smoothing
            ce = (1.0 - eps) * ce + eps * (lse - z.mean(dim=-1))
    else:
        lse, ce = torch.where(keep, lse_in, 0.0), None

    if grad is not None:
        # d ce / dz = softmax - (1-eps) onehot(y) - eps/V ;  d (s lse^2) / dz = 2 s lse softmax
        coef_p = coef_ce + 2.0 * opts.z_loss_scale * lse * coef_z
        # p <= 1: with lse_in from another GEMM a logit may round above it (exp could overflow).
        g = torch.exp((z - lse.unsqueeze(-1)).clamp_max_(0.0)) * coef_p.unsqueeze(-1)
        at_label = torch.where(in_block, coef_ce * (1.0 - opts.label_smoothing), 0.0)
        g.scatter_add_(-1, safe_labels, -at_label.unsqueeze(-1))
        if opts.label_smoothing:
            g -= (coef_ce * (opts.label_smoothing / vocab_total)).unsqueeze(-1)
        if u is not None:
            # 1 - tanh(u)^2 as 4e / (1 + e)^2, e = exp(-2|u|): no cancellation once tanh saturates.
            e = torch.exp(-2.0 * u.abs())
            g *= 4.0 * e / (1.0 + e).square()
        if opts.logit_scale is not None:
            g *= opts.scale
        g = torch.where(keep.unsqueeze(-1), g, 0.0)
        grad.copy_(g)

    if ce is None:
        return None, lse_in
    zero = torch.zeros((), dtype=ce.dtype, device=ce.device)
    return torch.where(keep, ce, zero), torch.where(keep, lse, zero)
