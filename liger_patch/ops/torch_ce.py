"""Row kernel in plain PyTorch: the CPU default and the readable statement of the math.

It has the same contract as the Triton row kernel (``triton_ce.ce_rows_triton``): given one chunk
of fp32 logits ``x = W h + b`` it returns the per-row cross-entropy and log-sum-exp and, when
row coefficients are given, writes d(loss)/dx into ``grad``.
"""

from __future__ import annotations

import torch

from liger_patch.ops.options import LossOptions


def ce_rows_torch(
    logits: torch.Tensor,
    labels: torch.Tensor,
    opts: LossOptions,
    grad: torch.Tensor | None = None,
    coef_ce: torch.Tensor | None = None,
    coef_z: torch.Tensor | None = None,
    lse_in: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss terms of a (rows, V) fp32 logits chunk.

    Returns ``(ce, lse)``, both 0 at ignored rows. With ``grad`` given, writes
    ``coef_ce[i] * d ce_i / dx + coef_z[i] * d lse_i^2 * z_loss_scale / dx`` into it (any dtype;
    it may alias ``logits``). ``lse_in`` is accepted for interface parity and not needed here.
    """
    del lse_in
    vocab = logits.shape[-1]
    keep = labels != opts.ignore_index
    safe_labels = torch.where(keep, labels, 0).unsqueeze(-1)

    x = logits.float()
    if opts.logit_scale is not None:
        x = x * opts.scale
    if opts.softcap is not None:
        tanh = torch.tanh(x / opts.softcap)
        z = opts.softcap * tanh
    else:
        z = x
    lse = torch.logsumexp(z, dim=-1)
    ce = lse - z.gather(-1, safe_labels).squeeze(-1)
    if opts.label_smoothing:
        eps = opts.label_smoothing
        ce = (1.0 - eps) * ce + eps * (lse - z.mean(dim=-1))

    if grad is not None:
        # d ce / dz = softmax - (1-eps) onehot(y) - eps/V ;  d (s lse^2) / dz = 2 s lse softmax
        coef_p = coef_ce + 2.0 * opts.z_loss_scale * lse * coef_z
        g = torch.exp(z - lse.unsqueeze(-1)) * coef_p.unsqueeze(-1)
        g.scatter_add_(-1, safe_labels, -(coef_ce * (1.0 - opts.label_smoothing)).unsqueeze(-1))
        if opts.label_smoothing:
            g -= (coef_ce * (opts.label_smoothing / vocab)).unsqueeze(-1)
        if opts.softcap is not None:
            g *= 1.0 - tanh * tanh
        if opts.logit_scale is not None:
            g *= opts.scale
        g = torch.where(keep.unsqueeze(-1), g, 0.0)
        grad.copy_(g)

    zero = torch.zeros((), dtype=ce.dtype, device=ce.device)
    return torch.where(keep, ce, zero), torch.where(keep, lse, zero)
