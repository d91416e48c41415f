"""The distillation loss of one chunk of token rows, and its gradient with respect to the
student's raw logits: the one statement of the row math (docs/distillation.md).

Notation: x the raw logits (W h + b) of a side, z = softcap(s x) its final logits, T the
temperature, a = z / T, log p = log_softmax(a) (p_s the student's, p_t the teacher's), y the
label, w = ce_weight. As TRL's ``generalized_jsd_loss``:

    D = KL(p_t || p_s)                                          beta = 0
    D = KL(p_s || p_t)                                          beta = 1
    D = beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t   otherwise
    loss = (1 - w) D + w ce,   ce = logsumexp(z_s) - z_s[y]     (the cross-entropy has no temperature)

and with respect to the student's a (each sum over the row's V columns):

    dD/da = p_s - p_t                                           beta = 0
    dD/da = p_s (log p_s - log p_t - D)                         beta = 1
    dD/da = (1 - beta) p_s (log p_s - log m - KL(p_s || m))     otherwise
    dce/da = T (softmax(z_s) - onehot(y))

(In the generalized JSD the teacher's term's derivative through m cancels the mixture's part of
the student's term: dD/dp_s = (1 - beta)(log p_s - log m).) Then da/dx = (s / T) softcap'(s x),
the chain the student's ``DistillOptions.student`` (temperature folded in) describes.

Everything here is fp32 and works in place on the chunk's buffers, so a chunk holds at most
``ROW_BUFFERS`` fp32 rows x V buffers at once (``distillation_chunks`` sizes chunks by it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from liger_patch.ops.core.contexts import without_grad
from liger_patch.ops.core.final_logits import final_logits, softcap_slope_, to_raw_logits_
from liger_patch.ops.distillation.options import DistillOptions, SideOptions

ROW_BUFFERS = 7
"""fp32 rows x V buffers a chunk holds at its peak (counted by tests/ops/distillation/test_loss.py):
with softcaps, the student's log-probs and softcap slope beside the teacher's logits and
``final_logits``' four temporaries; without, at most five (the two sides' log-probs, the
cross-entropy's gradient and the divergence's mixture and terms)."""


def _log_softmax_(z: Tensor) -> Tensor:
    """log_softmax over the last dimension, in z's own buffer."""
    return z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))


def _row_sum_of_products_(a: Tensor, b: Tensor) -> Tensor:
    """sum_j a_ij b_ij per row, leaving the products a_ij b_ij in ``b``'s buffer (no temporary;
    an fp32 sum, where a batched GEMM could run in TF32)."""
    return b.mul_(a).sum(dim=-1)


def _forward_kl_(ls: Tensor, lt: Tensor, want_grad: bool, _beta: float) -> tuple[Tensor, Tensor | None]:
    """KL(p_t || p_s) and its gradient p_s - p_t; consumes ``ls`` and ``lt``."""
    pt = lt.exp()
    d = _row_sum_of_products_(pt, lt.sub_(ls))
    return d, ls.exp_().sub_(pt) if want_grad else None


def _reverse_kl_sum_(ls: Tensor, lt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """sum_j p_s (log p_s - log p_t) per row over these columns, with p_s and the products p_s (log
    p_s - log p_t) (for the gradient); consumes ``ls`` and ``lt``."""
    terms = lt.neg_().add_(ls)  # log p_s - log p_t, then p_s times it
    ps = ls.exp_()
    return _row_sum_of_products_(ps, terms), ps, terms


def _less_row_sum_(products: Tensor, ps: Tensor, row_sum: Tensor) -> Tensor:
    """``products - p_s * row_sum`` per row, in ``products``' buffer: the gradient of a divergence
    whose derivative subtracts the whole row's sum (``row_sum``: over every column of the row)."""
    return products.addcmul_(ps, row_sum.unsqueeze(-1), value=-1.0)


def _reverse_kl_(ls: Tensor, lt: Tensor, want_grad: bool, _beta: float) -> tuple[Tensor, Tensor | None]:
    """KL(p_s || p_t) and its gradient p_s (log p_s - log p_t - D); consumes ``ls`` and ``lt``."""
    d, ps, products = _reverse_kl_sum_(ls, lt)
    return d, _less_row_sum_(products, ps, d) if want_grad else None


def _jsd_sums_(ls: Tensor, lt: Tensor, beta: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """KL(p_t || m) and KL(p_s || m) per row over these columns, with p_s and the products p_s (log
    p_s - log m) (for the gradient); consumes ``ls`` and ``lt``."""
    log_m = ls + math.log1p(-beta)
    s_terms = lt + math.log(beta)
    torch.logaddexp(log_m, s_terms, out=log_m)
    torch.sub(ls, log_m, out=s_terms)  # log p_s - log m, then p_s times it
    t_terms = log_m.neg_().add_(lt)  # log p_t - log m
    kl_t = _row_sum_of_products_(lt.exp_(), t_terms)
    del t_terms, log_m
    ps = ls.exp_()
    return kl_t, _row_sum_of_products_(ps, s_terms), ps, s_terms


def _generalized_jsd_(ls: Tensor, lt: Tensor, want_grad: bool, beta: float) -> tuple[Tensor, Tensor | None]:
    """beta KL(p_t || m) + (1 - beta) KL(p_s || m) and its gradient; consumes ``ls`` and ``lt``."""
    kl_t, kl_s, ps, products = _jsd_sums_(ls, lt, beta)
    d = beta * kl_t + (1.0 - beta) * kl_s
    if not want_grad:
        return d, None
    return d, _less_row_sum_(products, ps, kl_s).mul_(1.0 - beta)


def _divergence(beta: float):
    if beta == 0.0:
        return _forward_kl_
    return _reverse_kl_ if beta == 1.0 else _generalized_jsd_


def _cross_entropy(
    ls: Tensor, labels: Tensor, temperature: float, want_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """The student's cross-entropy without temperature, from its log-probs at temperature T:
    q = T log_softmax(z / T) is z shifted per row, so logsumexp(q) - q_y = logsumexp(z) - z_y;
    and its gradient with respect to a = z / T, T (softmax(q) - onehot(y)). ``ls`` is kept."""
    q = ls * temperature
    lse = torch.logsumexp(q, dim=-1)
    at_label = labels.unsqueeze(-1)
    ce = lse - q.gather(-1, at_label).squeeze(-1)
    if not want_grad:
        return ce, None
    g = q.sub_(lse.unsqueeze(-1)).exp_()
    g.scatter_add_(-1, at_label, torch.full_like(at_label, -1.0, dtype=g.dtype))
    return ce, g.mul_(temperature)


@without_grad
def side_log_probs(x: Tensor, side: SideOptions, want_slope: bool = False) -> tuple[Tensor, Tensor | None]:
    """log_softmax(a) of a side's (rows, V) raw logits ``x``, a = its final logits at the
    temperature (``side``: ``DistillOptions.student`` or ``.teacher``), and with ``want_slope``
    the softcap's slope at each logit (``None`` without a softcap). ``x`` may be consumed: pass it
    without keeping a reference, and its buffer is freed (or reused) as soon as it can be."""
    z, u = final_logits(x, side)
    del x
    slope = softcap_slope_(u) if want_slope and u is not None else None
    del u
    return _log_softmax_(z), slope


@without_grad
def distill_rows(
    ls: Tensor,
    lt: Tensor,
    slope: Tensor | None,
    labels: Tensor,
    opts: DistillOptions,
    coef: Tensor | None = None,
    ignored: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Each row's loss from the (rows, V) fp32 log-probs ``ls`` (student) and ``lt`` (teacher) at
    the temperature (``side_log_probs``), with labels ``labels`` (rows,); and with ``coef``
    (rows,) fp32, ``coef_i * d loss_i / d x_i`` (rows, V) fp32 with respect to the student's raw
    logits x (``slope``: the student's softcap slope, when it has a softcap). ``ls`` and ``lt``
    are consumed (the gradient may live in either's buffer). Every row is a kept token, unless
    ``ignored`` (rows,) bool marks the rows that are not: their loss and gradient are 0, as the
    Triton kernel writes them."""
    want_grad = coef is not None
    w = opts.ce_weight
    ce = g_ce = None
    if w:
        safe = labels if ignored is None else labels.masked_fill(ignored, 0)
        ce, g_ce = _cross_entropy(ls, safe, opts.temperature, want_grad)
    d, g = _divergence(opts.beta)(ls, lt, want_grad, opts.beta)
    del ls, lt
    loss = d if not w else (1.0 - w) * d + w * ce
    if ignored is not None:
        loss = loss.masked_fill(ignored, 0.0)
    if not want_grad:
        return loss, None
    if w:
        g.mul_(1.0 - w).add_(g_ce, alpha=w)
    del g_ce
    g.mul_(coef.unsqueeze(-1))
    if ignored is not None:
        g.masked_fill_(ignored.unsqueeze(-1), 0.0)
    return loss, to_raw_logits_(g, slope, opts.student)


# --- a vocabulary shard's columns -------------------------------------------------------------
# The vocabulary-parallel op (distillation_vocab_parallel.py) holds columns [o, o + V_r) of every
# row. With log p normalised by the whole rows' log-sum-exp, the divergences above give this
# shard's part of each row's sums; their gradients need the sums over every shard, passed in.


@without_grad
def side_logits(x: Tensor, side: SideOptions, want_slope: bool = False) -> tuple[Tensor, Tensor | None]:
    """a, a side's final logits at the temperature, from its (rows, V_r) raw logits ``x`` (not
    normalised: the shard sees part of each row), and with ``want_slope`` the softcap's slope
    (``None`` without a softcap); ``x`` may be consumed, as for :func:`side_log_probs`."""
    z, u = final_logits(x, side)
    del x
    return z, softcap_slope_(u) if want_slope and u is not None else None


@without_grad
def shard_stats(a_s: Tensor, a_t: Tensor, label_col: Tensor, opts: DistillOptions) -> list[Tensor]:
    """Per row over these columns: logsumexp of the student's and the teacher's a, and with a
    cross-entropy term logsumexp of z_s = T a_s and z_s at the label (0 where ``label_col``, the
    label's column here, is -1: the label is in another shard). Every shard's combine into the
    rows' (log-sum-exp over shards, sums)."""
    stats = [torch.logsumexp(a_s, dim=-1), torch.logsumexp(a_t, dim=-1)]
    if opts.ce_weight:
        z = a_s * opts.temperature
        at_label = z.gather(-1, label_col.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        stats += [torch.logsumexp(z, dim=-1), torch.where(label_col >= 0, at_label, 0.0)]
    return stats


@without_grad
def shard_divergence_parts(
    ls: Tensor, lt: Tensor, beta: float, want_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """This shard's part of the rows' divergence sums, (k, rows) from the log-probs ``ls`` and
    ``lt`` of its columns: [D] for beta 0 or 1, [KL(p_t || m), KL(p_s || m)] otherwise. Summed
    over shards they are the rows' (:func:`divergence_of_sums`); their last row is what the
    gradient subtracts. With ``want_grad`` also what the gradient is made of here, ``(terms,
    p_s)`` for :func:`shard_divergence_grad` (forward KL's terms are its gradient, p_s None);
    else ``(None, None)``. Consumes ``ls`` and ``lt``."""
    if beta == 0.0:
        d, g = _forward_kl_(ls, lt, want_grad, beta)
        return d.unsqueeze(0), g, None
    if beta == 1.0:
        d, ps, terms = _reverse_kl_sum_(ls, lt)
        sums = d.unsqueeze(0)
    else:
        kl_t, kl_s, ps, terms = _jsd_sums_(ls, lt, beta)
        sums = torch.stack([kl_t, kl_s])
    return (sums, terms, ps) if want_grad else (sums, None, None)


def divergence_of_sums(sums: Tensor, beta: float) -> Tensor:
    """D per row from the rows' sums of :func:`shard_divergence_parts` (summed over shards)."""
    return sums[0] if sums.shape[0] == 1 else beta * sums[0] + (1.0 - beta) * sums[1]


def shard_cross_entropy_grad(ls: Tensor, label_col: Tensor, temperature: float, lse_q: Tensor) -> Tensor:
    """T (softmax(q) - onehot(y)) over these columns, q = T log p_s (as :func:`_cross_entropy`),
    with ``lse_q`` the rows' logsumexp of q over every shard. ``ls`` is kept."""
    g = (ls * temperature).sub_(lse_q.unsqueeze(-1)).exp_()
    here = label_col >= 0
    g.scatter_add_(-1, label_col.clamp_min(0).unsqueeze(-1), here.to(g.dtype).neg_().unsqueeze(-1))
    return g.mul_(temperature)


@without_grad
def shard_divergence_grad(
    terms: Tensor,
    ps: Tensor | None,
    row_sum: Tensor,
    g_ce: Tensor | None,
    slope: Tensor | None,
    opts: DistillOptions,
    coef: Tensor,
) -> Tensor:
    """``coef_i * d loss_i / d x_i`` over these columns of the student's raw logits (``distill_rows``'
    gradient for a shard) from :func:`shard_divergence_parts`' ``terms`` and ``ps``: ``row_sum`` is
    the last row of the rows' divergence sums over every shard, ``g_ce`` the cross-entropy's
    gradient here (:func:`shard_cross_entropy_grad`, with a ``ce_weight``). Consumes ``terms``."""
    w, beta = opts.ce_weight, opts.beta
    g = terms if ps is None else _less_row_sum_(terms, ps, row_sum)
    if 0.0 < beta < 1.0:
        g.mul_(1.0 - beta)
    if w:
        g.mul_(1.0 - w).add_(g_ce, alpha=w)
    g.mul_(coef.unsqueeze(-1))
    return to_raw_logits_(g, slope, opts.student)
