"""Token chunks of the distillation loss: per chunk the student's and the teacher's logits
(``rows x V`` each, the only vocabulary-wide buffers), the row math (``distillation_rows``),
then ``grad_h = g W_s`` into its rows and ``grad_W_s += g^T h_s``: four GEMMs per kept token
in the forward (two logits, two gradients), the ``tokens x V`` logits never built.

Chunks walk the kept tokens only (``kept``: their row numbers), so ignored tokens cost no
GEMM. Rows per chunk follow from the working memory budget (``budget.working_bytes``): a row
costs ``ROW_BUFFERS`` fp32 logit rows plus its gathered hidden states and grad_h row.

The GEMMs run in the hidden states' dtype on CUDA and in fp32 on the CPU (``gemm.gemm_dtype_for``,
as the cross-entropy op's); on the CPU a half-precision weight is read through an fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from liger_patch.ops.budget import chunk_rows
from liger_patch.ops.distillation_options import DistillOptions
from liger_patch.ops.distillation_rows import ROW_BUFFERS, distill_rows, side_log_probs
from liger_patch.ops.gemm import gemm_dtype_for, gemm_logits
from liger_patch.ops.grad_weight_layout import accumulate_grad_weight
from liger_patch.ops.tuning import DEFAULT_TUNING

_F32 = torch.float32


@dataclass(frozen=True)
class Head:
    """One side's output projection and its input: hidden (N, H), weight (V, H), bias (V,) or None."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None


@dataclass
class DistillResult:
    """Per-token losses (N,) fp32, 0 at ignored tokens, and the student's gradients asked for
    (in their inputs' dtypes), else ``None``."""

    loss: Tensor
    grad_hidden: Tensor | None = None
    grad_weight: Tensor | None = None
    grad_bias: Tensor | None = None


def distill_chunk_rows(n_rows: int, vocab: int, student_width: int, teacher_width: int, budget: int) -> int:
    """Token rows per chunk within ``budget`` bytes of working memory (at least one): each row
    takes ``ROW_BUFFERS`` fp32 rows of V, its gathered student and teacher hidden states and its
    grad_h row (fp32 elements at most)."""
    width = ROW_BUFFERS * vocab + 2 * student_width + teacher_width
    return chunk_rows(width, budget, _F32.itemsize, DEFAULT_TUNING, n_rows)


class _Rows:
    """The rows a chunk covers: ``[start, stop)`` of every row, or of the kept rows' index."""

    def __init__(self, start: int, stop: int, kept: Tensor | None) -> None:
        self.start, self.stop = start, stop
        self.index = None if kept is None else kept[start:stop]

    def take(self, t: Tensor) -> Tensor:
        return t[self.start : self.stop] if self.index is None else t.index_select(0, self.index)

    def put(self, dst: Tensor, values: Tensor) -> None:
        if self.index is None:
            dst[self.start : self.stop] = values
        else:
            dst.index_copy_(0, self.index, values.to(dst.dtype))


def _operand(head: Head) -> tuple[Tensor, Tensor | None]:
    """The weight as the GEMMs read it, and the bias in fp32 (added in fp32 by ``gemm_logits``)."""
    w = head.weight.to(gemm_dtype_for(head.hidden))
    return w, None if head.bias is None else head.bias.float()


@torch.no_grad()
def run_distill(
    student: Head,
    teacher: Head,
    labels: Tensor,
    opts: DistillOptions,
    *,
    kept: Tensor | None,
    coef: Tensor | None,
    needs: tuple[bool, bool, bool],
    budget_bytes: int,
) -> DistillResult:
    """The loss of every token and, with ``coef`` (N,) fp32 (0 at ignored tokens), the gradients
    of ``coef_i * loss_i`` summed, for the student's hidden, weight and bias as ``needs`` asks.

    ``kept``: the kept tokens' row numbers (sorted), or ``None`` when every token is kept."""
    n_rows, vocab = labels.shape[0], student.weight.shape[0]
    ws, bs = _operand(student)
    wt, bt = _operand(teacher)
    want = coef is not None and any(needs)
    res = DistillResult(loss=torch.zeros(n_rows, dtype=_F32, device=labels.device))
    new = torch.zeros if kept is not None else torch.empty
    grad_w_sum = None
    if want and needs[0]:
        res.grad_hidden = new(student.hidden.shape, dtype=student.hidden.dtype, device=labels.device)
    if want and needs[1]:
        sum_dtype = _F32 if ws.dtype == _F32 else student.weight.dtype
        grad_w_sum = torch.zeros(student.weight.shape, dtype=sum_dtype, device=labels.device)
    if want and needs[2] and student.bias is not None:
        res.grad_bias = torch.zeros(vocab, dtype=_F32, device=labels.device)
    total = n_rows if kept is None else kept.shape[0]
    step = distill_chunk_rows(total, vocab, student.hidden.shape[1], teacher.hidden.shape[1], budget_bytes)
    for start in range(0, total, step):
        rows = _Rows(start, min(start + step, total), kept)
        hs = rows.take(student.hidden).to(ws.dtype)
        # The logits go straight into side_log_probs, which frees them as it goes.
        ls, slope = side_log_probs(gemm_logits(hs, ws, bs, _F32), opts.student, want_slope=want)
        ht = rows.take(teacher.hidden).to(wt.dtype)
        lt, _ = side_log_probs(gemm_logits(ht, wt, bt, _F32), opts.teacher)
        del ht
        loss, g = distill_rows(ls, lt, slope, rows.take(labels), opts, rows.take(coef) if want else None)
        del ls, lt, slope
        rows.put(res.loss, loss)
        if g is None:
            continue
        g_gemm = g.to(ws.dtype)
        if res.grad_hidden is not None:
            rows.put(res.grad_hidden, g_gemm @ ws)
        if grad_w_sum is not None:
            accumulate_grad_weight(grad_w_sum, g_gemm, hs, first=False)
        if res.grad_bias is not None:
            res.grad_bias += g.sum(dim=0)
        del g, g_gemm  # before the next chunk's buffers are made
    if grad_w_sum is not None:
        res.grad_weight = grad_w_sum.to(student.weight.dtype)
    if res.grad_bias is not None:
        res.grad_bias = res.grad_bias.to(student.bias.dtype)
    return res
