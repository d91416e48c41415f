"""Independent fp64 dense reference for the fused linear cross-entropy.

Written from "The math" in DESIGN.md, not from the implementation: it builds the full
tokens x vocab logits in float64 and lets autograd produce the gradients.

For token i with hidden h_i and label y_i (y_i == ignore_index: token ignored):
    z_i   = softcap(s * (W h_i + b)),  softcap(x) = c * tanh(x / c)
    lse_i = logsumexp_j z_ij
    ce_i  = (1 - e) * (lse_i - z_{i,y_i}) + e * (lse_i - mean_j z_ij)
    zl_i  = z_loss_scale * lse_i ** 2
    loss_i = ce_i + zl_i
Reductions: "none" -> per token (0 at ignored), "sum" -> sum over kept tokens,
"mean" -> that sum / (num_items_in_batch if given else number kept); nothing kept -> 0.
"""

from __future__ import annotations

import torch


class _Tanh(torch.autograd.Function):
    """tanh with derivative 1 / cosh(u)^2. Autograd's 1 - tanh(u)^2 is exactly 0 in fp64 once
    |u| > ~19, where the true derivative (e^-38 and below) is not: a reference must not round a
    gradient to 0 that an fp32 kernel computes correctly. Twice differentiable (plain ops)."""

    @staticmethod
    def forward(ctx, u):
        ctx.save_for_backward(u)
        return torch.tanh(u)

    @staticmethod
    def backward(ctx, grad):
        (u,) = ctx.saved_tensors
        return grad / torch.cosh(u).square()


def _as_float(x) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def reference_flce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss, z_loss) in float64, both reduced as `reduction` says.

    z_loss is the z_loss_scale * lse^2 part of loss, reduced the same way. The result is
    differentiable with respect to whichever of hidden/weight/bias require grad.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(reduction)
    lead = labels.shape
    h = hidden.reshape(labels.numel(), hidden.shape[-1]).to(torch.float64)  # not (-1, H): H may be 0
    y = labels.reshape(-1).to(torch.int64)

    x = h @ weight.to(torch.float64).T
    if bias is not None:
        x = x + bias.to(torch.float64)
    if logit_scale is not None:
        x = x * logit_scale
    if softcap is not None:
        x = softcap * _Tanh.apply(x / softcap)

    lse = torch.logsumexp(x, dim=-1)
    keep = y != ignore_index
    safe_y = torch.where(keep, y, torch.zeros_like(y))
    z_target = x.gather(1, safe_y[:, None]).squeeze(1)
    ce = lse - z_target
    if label_smoothing:
        e = label_smoothing
        ce = (1.0 - e) * ce + e * (lse - x.mean(dim=-1))
    zl = z_loss_scale * lse * lse

    zero = x.new_zeros(())
    per_token = torch.where(keep, ce + zl, zero)
    per_token_z = torch.where(keep, zl, zero)

    if reduction == "none":
        return per_token.reshape(lead), per_token_z.reshape(lead)
    total, total_z = per_token.sum(), per_token_z.sum()
    if reduction == "sum":
        return total, total_z
    n_kept = int(keep.sum())
    denom = _as_float(num_items_in_batch) if num_items_in_batch is not None else float(n_kept)
    if n_kept == 0:
        # Nothing kept: exactly zero, still attached to the graph.
        return total * 0.0, total_z * 0.0
    return total / denom, total_z / denom
