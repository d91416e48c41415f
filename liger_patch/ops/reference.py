"""Independent fp64 dense reference for the fused linear cross-entropy.

Written from "The math" in DESIGN.md, not from the implementation: it builds the full
tokens x vocab logits in float64 and lets autograd produce the gradients.

For token i with hidden h_i and label y_i (y_i == ignore_index: token ignored), V classes,
class weights w (all 1 without ``class_weight``):
    z_i   = softcap(s * (W h_i + b)),  softcap(x) = c * tanh(x / c)
    p_i   = softmax(z_i),  lse_i = logsumexp_j z_ij
    ce_i  = (1 - e) * w_{y_i} * (lse_i - z_{i,y_i}) + (e / V) * sum_j w_j * (lse_i - z_ij)
            (= (1 - e) * (lse_i - z_{i,y_i}) + e * (lse_i - mean_j z_ij) without class weights;
             F.cross_entropy's ``weight=`` and ``label_smoothing=``)
    zl_i  = z_loss_scale * lse_i ** 2            (not class-weighted)
    t_i   = detach(p_{i,y_i}) with use_token_scaling (TRL's loss_type="dft"), else 1
    loss_i = t_i * (ce_i + zl_i),  and the z_loss output is t_i * zl_i
Reductions: "none" -> per token (0 at ignored), "sum" -> sum over kept tokens,
"mean" -> that sum / D with D = num_items_in_batch if given, else sum over kept tokens of
w_{y_i} (the number kept without class weights); nothing kept, or class weights summing to 0
over the kept labels -> exactly 0; num_items_in_batch=0 is taken as 1.
The token scale never changes D.

Per-token outputs (``reference_token_outputs``; "none" -> per token, else the mean over kept
tokens, 0 when none is kept):
    predicted_i = argmax_j z_ij (first index among ties, as torch.argmax; -1 at ignored)
    correct_i   = predicted_i == y_i (False at ignored); token accuracy is its mean
    H_i         = -sum_j p_ij log p_ij (0 at ignored; differentiable)

Log-probs at a temperature T (``reference_logprobs``): the temperature divides the final
(softcapped) logits, as TRL's selective_log_softmax(logits / T) of a softcapping model:
    logp_i = log_softmax(z_i / T)[y_i],  H_i = entropy of softmax(z_i / T), both 0 at ignored.
"""

from __future__ import annotations

from collections import namedtuple

import torch

TokenOutputs = namedtuple("TokenOutputs", ("predicted", "correct", "entropy", "logits"))
"""``reference_token_outputs``' per-token results: argmax (int64, -1 at ignored), correctness
(bool, False at ignored), entropy (fp64, differentiable, 0 at ignored), and the final fp64
logits z (tokens x V, detached; for telling near-ties apart)."""

ReducedOutputs = namedtuple("ReducedOutputs", ("token_accuracy", "predicted_tokens", "entropy"))
"""``reference_outputs``' results, reduced as the op reduces them."""


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


def _final_logits(hidden, weight, labels, bias, softcap, logit_scale) -> torch.Tensor:
    """z = softcap(s * (W h + b)) in fp64, (tokens, V)."""
    h = hidden.reshape(labels.numel(), hidden.shape[-1]).to(torch.float64)  # not (-1, H): H may be 0
    x = h @ weight.to(torch.float64).T
    if bias is not None:
        x = x + bias.to(torch.float64)
    if logit_scale is not None:
        x = x * logit_scale
    if softcap is not None:
        x = softcap * _Tanh.apply(x / softcap)
    return x


def _labels(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat labels, kept mask, labels with ignored ones replaced by 0 for gathering)."""
    y = labels.reshape(-1).to(torch.int64).cpu()
    keep = y != ignore_index
    return y, keep, torch.where(keep, y, torch.zeros_like(y))


def _entropy(z: torch.Tensor) -> torch.Tensor:
    """-sum_j p_j log p_j per row, written as sum_j p_j (lse - z_j): every term >= 0."""
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    return (torch.exp(z - lse) * (lse - z)).sum(dim=-1)


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
    class_weight: torch.Tensor | None = None,
    use_token_scaling: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss, z_loss) in float64, both reduced as `reduction` says.

    z_loss is the z_loss_scale * lse^2 part of loss (times the token scale with
    ``use_token_scaling``), reduced the same way. ``class_weight`` (V,) is F.cross_entropy's
    ``weight=`` (the z-loss is not class-weighted). The result is differentiable with respect to
    whichever of hidden/weight/bias require grad.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(reduction)
    lead = labels.shape
    x = _final_logits(hidden, weight, labels, bias, softcap, logit_scale)
    y, keep, safe_y = _labels(labels, ignore_index)
    keep, safe_y = keep.to(x.device), safe_y.to(x.device)
    V = x.shape[-1]

    lse = torch.logsumexp(x, dim=-1)
    nll = lse - x.gather(1, safe_y[:, None]).squeeze(1)  # lse - z_y
    if class_weight is None:
        w = x.new_ones(V)
    else:
        w = class_weight.detach().to(device=x.device, dtype=torch.float64).reshape(V)
    w_y = w[safe_y]
    ce = w_y * nll
    if label_smoothing:
        e = label_smoothing
        smooth = ((lse[:, None] - x) * w).sum(dim=-1) / V  # (1/V) sum_j w_j (lse - z_j)
        ce = (1.0 - e) * ce + e * smooth
    zl = z_loss_scale * lse * lse
    if use_token_scaling:
        t = torch.softmax(x.detach(), dim=-1).gather(1, safe_y[:, None]).squeeze(1)
        ce, zl = t * ce, t * zl

    zero = x.new_zeros(())
    per_token = torch.where(keep, ce + zl, zero)
    per_token_z = torch.where(keep, zl, zero)

    if reduction == "none":
        return per_token.reshape(lead), per_token_z.reshape(lead)
    total, total_z = per_token.sum(), per_token_z.sum()
    if reduction == "sum":
        return total, total_z
    n_kept = int(keep.sum())
    if num_items_in_batch is not None:
        # num_items_in_batch=0 can only be right when nothing is kept: it is taken as 1.
        denom = _as_float(num_items_in_batch) or 1.0
    else:
        denom = float(torch.where(keep, w_y, zero).sum())
    if n_kept == 0 or denom == 0.0:
        # Nothing kept, or class weights that give every kept token weight 0: exactly zero,
        # still attached to the graph.
        return total * 0.0, total_z * 0.0
    return total / denom, total_z / denom


def reference_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> TokenOutputs:
    """Per-token argmax, correctness and entropy in labels' shape (see the module doc), and the
    fp64 final logits (tokens, V). Entropy is differentiable with respect to hidden/weight/bias."""
    lead = labels.shape
    z = _final_logits(hidden, weight, labels, bias, softcap, logit_scale)
    y, keep, _ = _labels(labels, ignore_index)
    if z.shape[0]:
        # the first index among equal maxima, spelled out (not relying on torch.argmax's ties)
        top = z.detach().amax(dim=-1, keepdim=True)
        cols = torch.arange(z.shape[-1], device=z.device).expand_as(z)
        first = torch.where(z.detach() == top, cols, z.shape[-1]).amin(dim=-1).cpu()
    else:
        first = torch.zeros(0, dtype=torch.int64)
    predicted = torch.where(keep, first, torch.full_like(first, -1))
    correct = keep & (predicted == y)
    entropy = torch.where(keep.to(z.device), _entropy(z), z.new_zeros(()))
    return TokenOutputs(predicted.reshape(lead), correct.reshape(lead), entropy.reshape(lead), z.detach())


def reference_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> ReducedOutputs:
    """token_accuracy (fp64), predicted_tokens (int64, per token) and entropy (fp64,
    differentiable) as the op returns them for ``reduction``: per token for "none", else the mean
    over kept tokens (0 when none is kept; also for "sum")."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(reduction)
    out = reference_token_outputs(
        hidden, weight, labels, bias, ignore_index=ignore_index, softcap=softcap, logit_scale=logit_scale
    )
    correct = out.correct.to(torch.float64)
    if reduction == "none":
        return ReducedOutputs(correct, out.predicted, out.entropy)
    n_kept = int((labels != ignore_index).sum())
    if n_kept == 0:
        return ReducedOutputs(correct.sum() * 0.0, out.predicted, out.entropy.sum() * 0.0)
    return ReducedOutputs(correct.sum() / n_kept, out.predicted, out.entropy.sum() / n_kept)


def reference_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(label), entropy) per token in labels' shape, fp64, under softmax(z / T) with
    z = softcap(s * (W h + b)); both 0 at ignored tokens and differentiable."""
    if not temperature > 0.0:
        raise ValueError(temperature)
    lead = labels.shape
    z = _final_logits(hidden, weight, labels, bias, softcap, logit_scale) / temperature
    _, keep, safe_y = _labels(labels, ignore_index)
    keep, safe_y = keep.to(z.device), safe_y.to(z.device)
    logp = torch.log_softmax(z, dim=-1).gather(1, safe_y[:, None]).squeeze(1)
    zero = z.new_zeros(())
    return torch.where(keep, logp, zero).reshape(lead), torch.where(keep, _entropy(z), zero).reshape(lead)
