"""The Triton backend's chunk of the distillation loss (``distillation_chunks.ChunkMath``).

Per chunk: the teacher's logits, then the student's, each stored in its hidden states' dtype
(bf16 / fp16 as an unpatched half-precision head stores them; fp32 inputs give fp32), or in fp32
with ``logits_dtype=torch.float32`` (cuBLAS's fp32 output of the half GEMM, never rounded to
half: TRL DistillationTrainer's precision). Half logits go through the backend's fused logits
GEMM where it takes both chunks (Hopper, half inputs, 16-byte aligned rows: ``triton/logits.py``),
which leaves each row's log-sum-exp partials, else through cuBLAS. Then one row kernel
(``triton/distill.py``) gives each row's loss and writes the student's gradient over its own
logits: element for element, into a narrower view of fp32 logits' bytes (a half gradient for
half GEMMs, ``gemm.grad_view``), or into a wider buffer on the CPU, whose GEMMs run in fp32. The
teacher's chunk is freed before the next chunk is built: at most two ``rows x V`` buffers.

Reverse KL (beta = 1) takes no partials: its online statistics pass gives the log-sum-exps with
the divergence, which its gradient needs before the last pass, so the partials would save
nothing and the fused GEMM is a little slower than cuBLAS. Nor do fp32 logits: the fused GEMM
stores half logits only (on the GPU), so the statistics pass gives them on every device.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from liger_patch.ops.core import head_start
from liger_patch.ops.core.backends import Backend, FusedLogits
from liger_patch.ops.core.budget import chunk_rows
from liger_patch.ops.core.gemm import LogitsGemm, chunk_logits, grad_view
from liger_patch.ops.core.walked_rows import Chunk
from liger_patch.ops.distillation.chunks import ChunkMath, Side
from liger_patch.ops.distillation.options import DistillOptions
from liger_patch.ops.distillation.triton.rows import distill_rows_triton


def fused_logits_for(backend: Backend, opts: DistillOptions) -> FusedLogits | None:
    """The fused logits GEMM this call may use: the backend's, unless the tuning turns it off,
    the divergence is reverse KL or the logits are asked for in fp32."""
    if opts.beta == 1.0 or not opts.student.tuning.fused_logits or opts.logits_dtype == torch.float32:
        return None
    return backend.fused_logits


def _step(
    backend: Backend,
    rows: Chunk,
    student: Side,
    teacher: Side,
    labels: Tensor,
    coef: Tensor | None,
    opts: DistillOptions,
    head: head_start.HeadStart | None = None,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One chunk (``ChunkMath.step``): both logits chunks, the row kernel, the gradient in place.
    ``head``: the teacher's logits begun before the label check (``start_head``), taken where
    this chunk begins with the rows it began, else dropped before this chunk's buffers exist."""
    hs = rows.take(student.hidden).to(student.w.dtype)
    ht = rows.take(teacher.hidden).to(teacher.w.dtype)
    s_dtype = opts.logits_dtype_for(student.hidden.dtype)  # the logits' dtypes
    t_dtype = opts.logits_dtype_for(teacher.hidden.dtype)
    fused = fused_logits_for(backend, opts)
    tuning = opts.student.tuning
    both = (
        fused is not None
        and fused.supported(hs, student.w, s_dtype, tuning)
        and fused.supported(ht, teacher.w, t_dtype, tuning)
    )
    via = backend if both else None  # partials for both sides or for neither
    if both and head is not None and head.fits(rows.index is not None, ht.shape[0]):
        lt, t_parts = head_start.finish(
            head, LogitsGemm(teacher.w, teacher.b, opts.teacher, t_dtype, backend), ht
        )
    else:
        if head is not None:
            head.take()  # dropped: its buffers are freed here
        lt, t_parts = chunk_logits(ht, teacher.w, teacher.b, opts.teacher, t_dtype, None, via)
    del ht
    ls, s_parts = chunk_logits(hs, student.w, student.b, opts.student, s_dtype, None, via)
    g = grad_view(ls, student.w.dtype) if coef is not None else None
    partials = (s_parts[:2], t_parts[:2]) if both else None
    chunk_coef = None if coef is None else rows.take(coef)
    loss = distill_rows_triton(ls, lt, rows.take(labels), opts, grad=g, coef=chunk_coef, partials=partials)
    return loss, g, hs


def start_head(
    backend: Backend,
    student: Side,
    teacher: Side,
    opts: DistillOptions,
    *,
    want_grad: bool,
    budget_bytes: int,
    keep: Tensor,
) -> head_start.HeadStart | None:
    """The first ``Tuning.head_start_gflop`` of the teacher's first logits chunk, launched before
    the forward waits for its label check (``head_start.start``), over the first rows that
    ``keep`` (the kept rows' mask) keeps. ``None`` where ``_step`` would not
    make that chunk with the fused GEMM as launched here (a cast of the hidden states first, no
    fused GEMM for this call, no rows)."""
    fused = fused_logits_for(backend, opts)
    hs, ht = student.hidden, teacher.hidden
    if fused is None or hs.shape[0] == 0 or hs.dtype != student.w.dtype or ht.dtype != teacher.w.dtype:
        return None
    row_bytes = _row_bytes(backend, student.w.shape[0], student, teacher, opts, want_grad, gathers=True)
    # Over the kept rows, whose count is not known yet, the first chunk has at most the rows the
    # budget holds unrounded (what ``chunk_rows`` gives when they all fit in one chunk).
    first = min(chunk_rows(row_bytes, budget_bytes, 1, opts.student.tuning, 1), hs.shape[0])
    s_dtype, t_dtype = opts.logits_dtype_for(hs.dtype), opts.logits_dtype_for(ht.dtype)
    if not fused.supported(hs[:first], student.w, s_dtype, opts.student.tuning):
        return None
    gemm = LogitsGemm(teacher.w, teacher.b, opts.teacher, t_dtype, backend)
    return head_start.start(gemm, ht, first, keep)


def _row_bytes(
    backend: Backend,
    vocab: int,
    student: Side,
    teacher: Side,
    opts: DistillOptions,
    want_grad: bool,
    gathers: bool,
) -> int:
    """Bytes per row at the chunk's peak, the largest of its three stages: the teacher's GEMM
    (its hidden rows, logits and partials, beside the student's rows), the row kernel (both
    logits and partials, the student's rows, and a gradient buffer where it is wider than the
    student's logits), and the gradient GEMMs (the teacher's chunk freed; grad_h's rows and
    their cast). Hidden rows count where the chunk copies them (gathered, or cast on the CPU).
    Logits take their stored width (``opts.logits_dtype``: 4 bytes for fp32)."""
    s_bytes = opts.logits_dtype_for(student.hidden.dtype).itemsize
    s_logit, t_logit = vocab * s_bytes, vocab * opts.logits_dtype_for(teacher.hidden.dtype).itemsize
    fused = fused_logits_for(backend, opts)
    part = 0 if fused is None else fused.partial_bytes_per_row(vocab, opts.student)
    s_width = student.hidden.shape[1] * student.w.element_size()

    def rows_of(side: Side) -> int:
        copied = gathers or side.hidden.dtype != side.w.dtype
        return side.hidden.shape[1] * side.w.element_size() if copied else 0

    # a buffer of its own only when the gradient is wider than the logits (``gemm.grad_view``)
    grad = vocab * student.w.element_size() if want_grad and student.w.element_size() > s_bytes else 0
    teacher_gemm = rows_of(student) + rows_of(teacher) + t_logit + part
    kernel = rows_of(student) + t_logit + s_logit + 2 * part + grad
    gradients = rows_of(student) + s_logit + grad + (2 * s_width if want_grad else 0)
    return max(teacher_gemm, kernel, gradients)


def triton_math(backend: Backend, head: head_start.HeadStart | None = None) -> ChunkMath:
    """The Triton backend's chunk work (``operator.chunk_math``); ``head`` goes to the
    first chunk's step."""
    heads = [] if head is None else [head]

    def step(*args, **kwargs):
        return _step(backend, *args, **kwargs, head=heads.pop() if heads else None)

    return ChunkMath(step=step, row_bytes=functools.partial(_row_bytes, backend))
