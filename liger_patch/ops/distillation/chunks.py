"""Token chunks of the distillation loss: per chunk the student's and the teacher's logits
(``rows x V`` each, the only vocabulary-wide buffers), the row math, then ``grad_h = g W_s`` into
its rows and ``grad_W_s += g^T h_s``: four GEMMs per kept token in the forward (two logits, two
gradients), the ``tokens x V`` logits never built.

Chunks walk the kept tokens only (``kept``: their row numbers), so ignored tokens cost no
GEMM. What a chunk holds depends on the backend (``ChunkMath``): the PyTorch one turns both
chunks into fp32 log-probabilities (``distillation_rows``; ``ROW_BUFFERS`` fp32 rows of V at its
peak), the Triton one keeps them in the input dtype and runs one row kernel over both
(``distillation_triton``). Chunk per chunk follow from the working memory budget
(``budget.working_bytes``) and the backend's bytes per row. The loop itself (``walk_chunks``) also
runs each pass of the vocabulary-parallel op (``distillation_vocab_parallel``), with its steps.

The GEMMs run in the hidden states' dtype on CUDA and in fp32 on the CPU (``gemm.gemm_dtype_for``,
as the cross-entropy op's); on the CPU a half-precision weight is read through an fp32 copy.
grad_W is summed in fp32 when the GEMMs run in fp32, else in the weight's dtype (the first chunk
overwrites it, as the cross-entropy op's weight-dtype sum does); grad_b in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from liger_patch.ops.core.budget import chunk_rows
from liger_patch.ops.core.contexts import without_grad
from liger_patch.ops.core.gemm import gemm_dtype_for, gemm_logits
from liger_patch.ops.core.grad_sums import GradSums
from liger_patch.ops.core.grad_weight_layout import GradWeightLater, WeightSpec
from liger_patch.ops.core.walked_rows import Chunk, chunks
from liger_patch.ops.distillation.options import DistillOptions, SideOptions
from liger_patch.ops.distillation.rows import ROW_BUFFERS, distill_rows, side_log_probs

_F32 = torch.float32

FinalLogits = Callable[[Tensor, SideOptions, bool], tuple[Tensor, Tensor | None]]
"""``side_log_probs`` or ``side_logits``: a side's raw logits chunk to its fp32 values (and slope)."""


@dataclass(frozen=True)
class Head:
    """One side's output projection and its input: hidden (N, H), weight (V, H), bias (V,) or None."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None


@dataclass(frozen=True)
class Side:
    """One side as the chunk GEMMs read it: hidden (N, H), the weight in the GEMMs' dtype
    (``w``) and the bias in fp32 (``b``, added in fp32 by the logits GEMM)."""

    hidden: Tensor
    w: Tensor
    b: Tensor | None

    @classmethod
    def of(cls, head: Head) -> Side:
        w = head.weight.to(gemm_dtype_for(head.hidden))
        return cls(head.hidden, w, None if head.bias is None else head.bias.float())


@dataclass
class DistillResult:
    """Per-token losses (N,) fp32, 0 at ignored tokens, and the student's gradients asked for
    (in their inputs' dtypes), else ``None``."""

    loss: Tensor
    grad_hidden: Tensor | None = None
    grad_weight: Tensor | None = None
    grad_bias: Tensor | None = None
    grad_weight_later: GradWeightLater | None = None  # ``DistillCall.leave_weight``


@dataclass(frozen=True)
class ChunkMath:
    """What a backend (or a pass of the vocabulary-parallel op) does per chunk.

    ``step(rows, student, teacher, labels, coef, opts) -> (values, g, hs)``: the chunk's per-row
    values (a backend's: its losses (rows,) fp32), or ``None``; with ``coef``
    ``coef_i * d loss_i / d x`` (rows, V) for the student's raw logits x (else ``None``); and the
    student's hidden rows as the GEMMs read them. ``labels`` and ``coef`` (or ``None``) are
    whole-length: the step takes its rows of them when it needs them.
    ``row_bytes(vocab, student, teacher, opts, want_grad, gathers)``: the working bytes a chunk
    takes per row at its peak (``gathers``: its rows are gathered kept rows, not a slice)."""

    step: Callable[..., tuple[Tensor, Tensor | None, Tensor]]
    row_bytes: Callable[..., int]


def torch_row_bytes(
    vocab: int, student: Side, teacher: Side, opts: DistillOptions, want_grad: bool, gathers: bool
) -> int:
    """``ROW_BUFFERS`` fp32 rows of V, the gathered student and teacher hidden states and a grad_h
    row (fp32 elements at most)."""
    return _F32.itemsize * (ROW_BUFFERS * vocab + 2 * student.hidden.shape[1] + teacher.hidden.shape[1])


def side_chunk(
    rows: Chunk, side: Side, side_opts: SideOptions, final: FinalLogits, want_slope: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """One side's hidden rows of the chunk as the GEMMs read them, and ``final`` of their fp32
    logits, passed on without a reference kept (``side_log_probs``, or a shard's
    ``side_logits``): the side's (rows, V) fp32 values and, with ``want_slope``, its softcap's
    slope."""
    h = rows.take(side.hidden).to(side.w.dtype)
    values, slope = final(gemm_logits(h, side.w, side.b, _F32), side_opts, want_slope)
    return h, values, slope


def _torch_step(
    rows: Chunk,
    student: Side,
    teacher: Side,
    labels: Tensor,
    coef: Tensor | None,
    opts: DistillOptions,
    *,
    with_ignored: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """The PyTorch chunk: fp32 logits, straight into ``side_log_probs`` (which frees them as it
    goes), then ``distill_rows``; ``with_ignored``: the rows may include ignored tokens."""
    want = coef is not None
    hs, ls, slope = side_chunk(rows, student, opts.student, side_log_probs, want_slope=want)
    lt = side_chunk(rows, teacher, opts.teacher, side_log_probs)[1]  # the teacher's rows freed
    chunk_labels = rows.take(labels)
    ignored = chunk_labels == opts.ignore_index if with_ignored else None
    loss, g = distill_rows(ls, lt, slope, chunk_labels, opts, rows.take(coef) if want else None, ignored)
    return loss, g, hs


TORCH_MATH = ChunkMath(step=_torch_step, row_bytes=torch_row_bytes)
"""The PyTorch chunk of a walk over kept tokens only."""
TORCH_MATH_WITH_IGNORED = ChunkMath(
    step=functools.partial(_torch_step, with_ignored=True), row_bytes=torch_row_bytes
)
"""The PyTorch chunk of a walk over every row while some may be ignored (under the skip share,
or while a CUDA graph is captured): their loss and gradient are 0, as the Triton kernel writes."""


def grad_weight_dtype(student: Head, ws: Tensor) -> torch.dtype:
    """What grad_W is summed in: fp32 where the GEMMs run in fp32 (``ws``: the weight as they
    read it), else the weight's dtype."""
    return _F32 if ws.dtype == _F32 else student.weight.dtype


def student_grads(
    student: Head, ws: Tensor, needs: tuple[bool, bool, bool], kept: Tensor | None, *, in_fp32: bool = False
) -> GradSums:
    """The student's gradient buffers: grad_h in the hidden states' dtype, grad_W summed in fp32
    when the GEMMs run in fp32 (else in the weight's dtype, the first chunk overwriting it), grad_b
    in fp32. With ``in_fp32`` every one is summed in fp32 from zeros: a vocabulary shard's, whose
    grad_h is summed over the group before it is rounded. ``kept``: the rows the chunks walk
    (``None``: every row); rows skipped get zeros."""
    device = student.hidden.device
    total = student.hidden.shape[0] if kept is None else kept.shape[0]
    overwrite_first = not in_fp32
    grad_hidden = grad_sum = grad_bias = None
    if needs[0]:  # skipped rows read as ignored ones: zeros
        new = torch.empty if kept is None else torch.zeros
        dtype = _F32 if in_fp32 else student.hidden.dtype
        grad_hidden = new(student.hidden.shape, dtype=dtype, device=device)
    if needs[1]:  # no chunk to overwrite it: zeros
        sum_dtype = _F32 if in_fp32 else grad_weight_dtype(student, ws)
        new = torch.empty if total and overwrite_first else torch.zeros
        grad_sum = new(student.weight.shape, dtype=sum_dtype, device=device)
    if needs[2] and student.bias is not None:
        grad_bias = torch.zeros(student.weight.shape[0], dtype=_F32, device=device)
    return GradSums(grad_hidden, grad_sum, grad_bias, overwrite_first)


def finished_grads(sums: GradSums, student: Head) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """grad_h, grad_W and grad_b (``None`` where not asked for) in their inputs' dtypes."""
    inputs = (student.hidden, student.weight, student.bias)
    summed = (sums.hidden, sums.weight, sums.bias)
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(summed, inputs, strict=True))


def distill_chunk_rows(
    math: ChunkMath,
    total: int,
    student: Side,
    teacher: Side,
    opts: DistillOptions,
    *,
    want_grad: bool,
    gathers: bool,
    budget: int,
) -> int:
    """Token rows per chunk within ``budget`` bytes of working memory (at least one), as the
    cross-entropy op rounds them (``budget.chunk_rows``)."""
    row_bytes = math.row_bytes(student.w.shape[0], student, teacher, opts, want_grad, gathers)
    return chunk_rows(row_bytes, budget, 1, opts.student.tuning, total)


@dataclass(frozen=True)
class ChunkWalk:
    """What every chunk of a walk reads: both sides as the GEMMs read them, the labels (N,), the
    options, the rows walked (``kept``: the kept tokens' row numbers, sorted; ``None``: every
    row) and the working memory budget the chunks are sized for."""

    student: Side
    teacher: Side
    labels: Tensor
    opts: DistillOptions
    kept: Tensor | None
    budget_bytes: int

    def rows_per_chunk(self, math: ChunkMath, want_grad: bool) -> int:
        """How many rows each chunk of this walk takes (``distill_chunk_rows``)."""
        total = self.labels.shape[0] if self.kept is None else self.kept.shape[0]
        gathers = self.kept is not None
        return distill_chunk_rows(
            math, total, self.student, self.teacher, self.opts,
            want_grad=want_grad, gathers=gathers, budget=self.budget_bytes,
        )  # fmt: skip

    def one_chunk(self, math: ChunkMath, want_grad: bool) -> bool:
        """Whether this walk is one chunk of every row."""
        return self.kept is None and self.rows_per_chunk(math, want_grad) >= self.labels.shape[0]


@without_grad
def walk_chunks(
    math: ChunkMath,
    walk: ChunkWalk,
    *,
    coef: Tensor | None,
    values: Tensor | None = None,
    grads: GradSums | None = None,
    keep_last: bool = False,
) -> tuple[Tensor, Tensor] | None:
    """The one chunk loop: ``math.step`` over the rows ``walk`` covers in chunks within its
    budget, each chunk's per-row values put in its rows of ``values`` and its gradient added to
    ``grads``. With ``keep_last`` the last chunk's gradient and hidden rows as the GEMMs read
    them are returned (for a grad_W made later: ``run_distill``)."""
    student, teacher, labels, opts, kept = walk.student, walk.teacher, walk.labels, walk.opts, walk.kept
    last = None
    for rows in chunks(labels.shape[0], kept, walk.rows_per_chunk(math, grads is not None)):
        row_values, g, hs = math.step(rows, student, teacher, labels, coef, opts)
        if values is not None:
            rows.put(values, row_values)
        if g is not None:
            grads.add(rows, g, hs, student.w)
            last = (g.to(student.w.dtype), hs) if keep_last else None
        del row_values, g, hs  # before the next chunk's buffers are made
    return last


@dataclass(frozen=True)
class DistillCall:
    """One call of ``run_distill``: the loss of every token of ``labels`` (N,) and, with ``coef``
    (N,) fp32 (0 at ignored tokens), the gradients of ``coef_i * loss_i`` summed, for the
    student's hidden, weight and bias as ``needs`` asks.

    ``kept``: the kept tokens' row numbers (sorted), or ``None`` when every token is kept.
    ``budget_bytes``: the chunks' working memory. ``math``: the backend's chunk work
    (``operator.chunk_math``). ``leave_weight``: where the walk is one chunk of every row,
    grad_W is not made but left to the result's ``grad_weight_later`` (a CUDA graph of the
    forward leaves it out: ``core/graphed_forward.Later``)."""

    student: Head
    teacher: Head
    labels: Tensor
    opts: DistillOptions
    kept: Tensor | None
    coef: Tensor | None
    needs: tuple[bool, bool, bool]
    budget_bytes: int
    math: ChunkMath = TORCH_MATH
    leave_weight: bool = False


@without_grad
def run_distill(call: DistillCall) -> DistillResult:
    """The losses and gradients ``call`` asks for (``DistillCall``)."""
    student, labels, needs, kept = call.student, call.labels, call.needs, call.kept
    s, t = Side.of(student), Side.of(call.teacher)
    want = call.coef is not None and any(needs)
    res = DistillResult(loss=torch.zeros(labels.shape[0], dtype=_F32, device=labels.device))
    walk = ChunkWalk(s, t, labels, call.opts, kept, call.budget_bytes)
    later = call.leave_weight and want and needs[1] and walk.one_chunk(call.math, True)
    grads = student_grads(student, s.w, (needs[0], needs[1] and not later, needs[2]), kept) if want else None
    last = walk_chunks(
        call.math, walk, coef=call.coef if want else None, values=res.loss, grads=grads, keep_last=later
    )
    if grads is not None:
        res.grad_hidden, res.grad_weight, res.grad_bias = finished_grads(grads, student)
    if later:  # the grad_W ``student_grads`` and the chunk's ``GradSums.add`` would make
        spec = WeightSpec(student.weight.shape, student.weight.dtype, student.weight.device)
        res.grad_weight_later = GradWeightLater(*last, grad_weight_dtype(student, s.w), True, spec)
    return res
