"""Per-token statistics of one vocabulary shard's logits, and how the shards' statistics combine.

A rank that holds columns ``[offset, offset + V_r)`` of every token's logits (rows of the
weight, ``vocab_parallel``) cannot compute a token's cross-entropy alone, but it can compute, per
token, a few numbers over its own columns from which the whole row's loss and outputs follow
exactly. With z the final logits (``torch_ce.final_logits``: scale, then softcap) of the shard:

* ``lse``: logsumexp_j z_j (0 at ignored tokens), from the backend's row kernel;
* ``label_logit``: z_y when the label falls in the shard, else 0 (so the shards' sum is z_y);
* ``logit_sum`` (label smoothing): sum_j z_j, or sum_j w_j z_j with class weights;
* ``max`` and ``argmax`` (token accuracy, predicted tokens): the shard's largest z and its global
  column, the first one among ties (the row kernel's argmax);
* ``entropy`` (return_entropy): the entropy of the shard's own softmax, H_r = sum_j p^r_j (lse_r - z_j).

:func:`combine` turns every shard's numbers into the row's: with m = max_r lse_r,
e_r = exp(lse_r - m) and S = sum_r e_r,

    lse = m + log S,    z_y = sum_r label_logit_r,    sum_j z_j = sum_r logit_sum_r,
    H   = log S + sum_r e_r (H_r + m - lse_r) / S      (every term >= 0: no cancellation),
    argmax = the smallest column among the shards whose maximum is the largest.

Every shard's numbers reach every rank (an all-gather), and each rank combines them with the
same code, so the combined values are the same on every rank, bit for bit.
"""

from __future__ import annotations

import torch

from liger_patch.ops.core import budget
from liger_patch.ops.core.contexts import without_grad
from liger_patch.ops.core.final_logits import final_logits
from liger_patch.ops.core.gemm import gemm_dtype_for, gemm_logits
from liger_patch.ops.cross_entropy.backends import RowBackend
from liger_patch.ops.cross_entropy.chunk_call import HeadInputs
from liger_patch.ops.cross_entropy.options import LossOptions, build_options
from liger_patch.ops.cross_entropy.row_io import ChunkRecords, ClassWeight, RowOutputs

_F32, _F64 = torch.float32, torch.float64


def stat_names(opts: LossOptions) -> tuple[str, ...]:
    """The statistics a call needs, in the order of the rows of :func:`shard_stats`' result."""
    names = ["lse", "label_logit"]
    if opts.label_smoothing:
        names.append("logit_sum")
    if opts.return_token_accuracy or opts.return_predicted_tokens:
        names += ["max", "argmax"]
    if opts.return_entropy:
        names.append("entropy")
    return tuple(names)


def _final(x: torch.Tensor, opts: LossOptions) -> torch.Tensor:
    return final_logits(x, opts)[0]


_SUM_COLUMNS = 4096
"""Columns of fp32 final logits made at a time for the label-smoothing sum (``_logit_sum``)."""


def _logit_sum(logits: torch.Tensor, opts: LossOptions, w_cols: torch.Tensor | None) -> torch.Tensor:
    """sum_j z_j per row (sum_j w_j z_j with class weights), in fp32, over blocks of columns so
    that the fp32 copy of z stays small beside the chunk."""
    total = torch.zeros(logits.shape[0], dtype=_F32, device=logits.device)
    for c0 in range(0, logits.shape[1], _SUM_COLUMNS):
        z = _final(logits[:, c0 : c0 + _SUM_COLUMNS], opts)
        total += z.sum(dim=1) if w_cols is None else z @ w_cols[c0 : c0 + _SUM_COLUMNS]
    return total


def _kernel_labels(labels: torch.Tensor, local: torch.Tensor, in_shard: torch.Tensor, opts: LossOptions):
    """Labels for the row kernel over the shard's columns: the local column where the label is in
    the shard, column 0 for the other kept tokens (they still need the shard's log-sum-exp; the
    kernel's cross-entropy is not used), ``ignore_index`` where ignored."""
    kept = labels != opts.ignore_index
    return torch.where(in_shard, local, torch.where(kept, 0, labels))


def _chunk_stats(
    backend: RowBackend,
    logits: torch.Tensor,
    labels: torch.Tensor,
    opts: LossOptions,
    offset: int,
    w_cols: torch.Tensor | None,
    out: dict[str, torch.Tensor],
) -> None:
    """Write one token chunk's statistics into ``out`` (name -> this chunk's row of the result)."""
    vocab_r = logits.shape[1]
    keep = labels != opts.ignore_index
    local = labels - offset
    in_shard = keep & (local >= 0) & (local < vocab_r)
    rows = RowOutputs(
        argmax=torch.empty_like(labels) if "argmax" in out else None,
        entropy=torch.empty(labels.shape, dtype=_F32, device=labels.device) if "entropy" in out else None,
    )
    # Only lse and the records are read from the kernel: with smoothing its unused ce would sum every row.
    kernel_opts = build_options(opts.key, label_smoothing=0.0)
    kernel_labels = _kernel_labels(labels, local, in_shard, opts)
    records = ChunkRecords(outputs=rows if rows.any() else None)
    _, lse = backend.row_kernel(logits, kernel_labels, kernel_opts, records=records)
    out["lse"].copy_(lse)
    at_label = logits.gather(1, torch.where(in_shard, local, 0).unsqueeze(1)).squeeze(1)
    out["label_logit"].copy_(torch.where(in_shard, _final(at_label, opts), 0.0))
    if "logit_sum" in out:
        out["logit_sum"].copy_(torch.where(keep, _logit_sum(logits, opts, w_cols), 0.0))
    if "argmax" in out:
        col = rows.argmax.clamp_min(0)
        top = _final(logits.gather(1, col.unsqueeze(1)).squeeze(1), opts)
        out["max"].copy_(torch.where(keep, top, -torch.inf))
        out["argmax"].copy_(torch.where(keep, col + offset, 0))
    if "entropy" in out:
        out["entropy"].copy_(rows.entropy)


def _empty_shard_stats(stats: torch.Tensor, names: tuple[str, ...]) -> torch.Tensor:
    """A shard without columns (V smaller than the group's split leaves a rank none): it adds
    nothing, exp(lse_r) = 0 and its maximum is never the largest."""
    for name in ("lse", "max"):
        if name in names:
            stats[names.index(name)] = -torch.inf
    return stats


@without_grad
def shard_statistics(
    backend: RowBackend,
    inputs: HeadInputs,
    labels: torch.Tensor,
    opts: LossOptions,
    offset: int,
    class_weight: ClassWeight | None,
) -> torch.Tensor:
    """The statistics of :func:`stat_names` for every token (rows) over this shard's columns
    (``inputs``: the hidden states, the shard's rows of the weight and bias),
    as a ``(len(names), N)`` fp64 tensor (fp64 so that a column index travels exactly).

    Token chunks as large as the memory budget allows (``budget.chunk_rows``); each chunk's
    logits are the only ``rows x V_r`` buffer, as in the unsharded op's forward.
    """
    names = stat_names(opts)
    hidden, weight, bias = inputs.hidden, inputs.weight, inputs.bias
    n, vocab_r = labels.shape[0], weight.shape[0]
    stats = torch.zeros(len(names), n, dtype=_F64, device=hidden.device)
    if vocab_r == 0:
        return _empty_shard_stats(stats, names)
    logits_dtype = opts.logits_dtype or hidden.dtype
    working = budget.working_bytes(opts.memory_budget, n, hidden.nbytes)
    rows = budget.chunk_rows(vocab_r, working, logits_dtype.itemsize, opts.tuning)
    w = weight.to(gemm_dtype_for(hidden))
    b = None if bias is None else bias.float()
    w_cols = None if class_weight is None else class_weight.weight[offset : offset + vocab_r]
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        logits = gemm_logits(hidden[start:stop].to(w.dtype), w, b, logits_dtype)
        out = {
            name: torch.empty(
                stop - start, dtype=torch.int64 if name == "argmax" else _F32, device=hidden.device
            )
            for name in names
        }
        _chunk_stats(backend, logits, labels[start:stop], opts, offset, w_cols, out)
        for i, name in enumerate(names):
            stats[i, start:stop] = out[name]
        del logits
    return stats


def combine(gathered: torch.Tensor, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The rows' values from every shard's statistics: ``gathered`` is ``(shards, len(names), N)``.

    Returns fp32 ``lse``, ``label_logit``, and as asked ``logit_sum``, ``entropy`` and int64
    ``argmax`` (values at ignored tokens are meaningless: the caller masks them).
    """
    g = dict(zip(names, gathered.unbind(1), strict=True))
    lse_r = g["lse"]
    m = lse_r.amax(dim=0)
    e = torch.exp(lse_r - m)
    s = e.sum(dim=0)
    res = {"lse": m + torch.log(s), "label_logit": g["label_logit"].sum(dim=0)}
    if "logit_sum" in g:
        res["logit_sum"] = g["logit_sum"].sum(dim=0)
    if "entropy" in g:
        # an empty shard has e_r = 0 and m - lse_r = inf: its term is 0, not NaN
        terms = torch.where(e > 0, e * (g["entropy"] + (m - lse_r)), 0.0)
        res["entropy"] = torch.log(s) + terms.sum(dim=0) / s
    out = {name: value.float() for name, value in res.items()}
    if "argmax" in g:
        top = g["max"].amax(dim=0)
        cols = torch.where(g["max"] == top, g["argmax"], torch.inf)
        out["argmax"] = cols.amin(dim=0).long()
    return out
