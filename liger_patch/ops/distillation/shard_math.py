"""The row math of one token chunk of a vocabulary shard, per backend, for the
vocabulary-parallel distillation op (``distillation_vocab_parallel``), which runs the collectives
between its steps:

1. ``open``: both sides' logits chunks over the shard's columns (rows, V_r) and the student's
   hidden rows as the GEMMs read them;
2. ``stats``: per row over these columns, ``distillation_rows.shard_stats``' values (k, rows);
3. ``sums``: with the whole rows' log-sum-exps, the shard's part of the divergence sums (k, rows)
   (``distillation_rows.shard_divergence_parts``);
4. ``grad``: with the rows' sums, ``coef * d loss / d x_s`` at these columns.

``TORCH`` keeps fp32 final logits and works in place on them (``distillation_rows``' shard
functions; ``ROW_BUFFERS`` fp32 rows of V_r at its peak); ``TritonMath`` keeps the logits as the
single-GPU Triton path stores them (the hidden states' dtype, or ``logits_dtype``) and runs one
row kernel per step (``triton/distill_shard.py``), the gradient written over the student's logits.
A chunk's state lives in a ``ShardChunk``, released by the caller once its gradient is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from liger_patch.ops.core.backends import Backend, FusedLogits
from liger_patch.ops.core.gemm import chunk_logits, grad_view
from liger_patch.ops.core.walked_rows import Chunk
from liger_patch.ops.distillation.chunks import Side, side_chunk, torch_row_bytes
from liger_patch.ops.distillation.options import DistillOptions
from liger_patch.ops.distillation.rows import (
    shard_cross_entropy_grad,
    shard_divergence_grad,
    shard_divergence_parts,
    shard_stats,
    side_logits,
)

_F32 = torch.float32


@dataclass
class ShardChunk:
    """One chunk's buffers over the shard's columns: the student's hidden rows (``hs``), both
    sides' logits (``s``, ``t``: fp32 final logits for ``TORCH``, raw logits as stored for
    ``TritonMath``), the student's softcap slope (``TORCH``), and what ``sums`` leaves for ``grad``."""

    hs: Tensor
    s: Tensor
    t: Tensor
    slope: Tensor | None = None
    partials: tuple | None = None  # both sides' (pmax, psum) from the fused logits GEMM
    g_ce: Tensor | None = None
    terms: Tensor | None = None
    ps: Tensor | None = None


def lse_q(stats: dict, opts: DistillOptions) -> Tensor:
    """logsumexp(T log p_s) = logsumexp(z_s) - T lse_s, what the PyTorch cross-entropy gradient takes."""
    return stats["lse_z"] - opts.temperature * stats["lse_s"]


class _TorchMath:
    """fp32 final logits, ``distillation_rows``' shard functions in place."""

    name = "torch"

    @staticmethod
    def open(rows: Chunk, student: Side, teacher: Side, opts: DistillOptions, want_grad: bool) -> ShardChunk:
        hs, a_s, slope = side_chunk(rows, student, opts.student, side_logits, want_grad)
        a_t = side_chunk(rows, teacher, opts.teacher, side_logits)[1]
        return ShardChunk(hs, a_s, a_t, slope)

    @staticmethod
    def stats(chunk: ShardChunk, label_cols: Tensor, opts: DistillOptions) -> Tensor:
        return torch.stack(shard_stats(chunk.s, chunk.t, label_cols, opts))

    @staticmethod
    def sums(
        chunk: ShardChunk, stats: dict, label_cols: Tensor, opts: DistillOptions, want_grad: bool
    ) -> Tensor:
        """The shard's sums; with ``want_grad`` the gradient's parts stay in ``chunk`` (its
        log-probs are consumed)."""
        ls = chunk.s.sub_(stats["lse_s"].unsqueeze(-1))
        lt = chunk.t.sub_(stats["lse_t"].unsqueeze(-1))
        chunk.s = chunk.t = None
        if want_grad and opts.ce_weight:
            chunk.g_ce = shard_cross_entropy_grad(ls, label_cols, opts.temperature, lse_q(stats, opts))
        sums, chunk.terms, chunk.ps = shard_divergence_parts(ls, lt, opts.beta, want_grad)
        return sums

    @staticmethod
    def grad(
        chunk: ShardChunk,
        stats: dict,
        row_sum: Tensor,
        label_cols: Tensor,
        coef: Tensor,
        opts: DistillOptions,
    ) -> Tensor:
        terms, chunk.terms = chunk.terms, None
        return shard_divergence_grad(terms, chunk.ps, row_sum, chunk.g_ce, chunk.slope, opts, coef)

    @staticmethod
    def row_bytes(
        vocab: int, student: Side, teacher: Side, opts: DistillOptions, want_grad: bool, gathers: bool
    ):
        return torch_row_bytes(vocab, student, teacher, opts, want_grad, gathers)


class TritonMath:
    """Logits as stored, one row kernel per step (``triton/distill_shard.py``). Without a
    cross-entropy term, both logits chunks come through the backend's fused logits GEMM where
    it takes them (as the whole op's: ``distillation_triton.fused_logits_for``), and the shard's
    log-sum-exps from its partials, so the statistics need no pass over the chunks."""

    name = "triton"

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def _fused(self, opts: DistillOptions) -> FusedLogits | None:
        from liger_patch.ops.distillation.triton_chunk import fused_logits_for

        return None if opts.ce_weight else fused_logits_for(self.backend, opts)

    def open(
        self, rows: Chunk, student: Side, teacher: Side, opts: DistillOptions, want_grad: bool
    ) -> ShardChunk:
        hs = rows.take(student.hidden).to(student.w.dtype)
        ht = rows.take(teacher.hidden).to(teacher.w.dtype)
        s_dtype = opts.logits_dtype_for(student.hidden.dtype)
        t_dtype = opts.logits_dtype_for(teacher.hidden.dtype)
        fused, tuning = self._fused(opts), opts.student.tuning
        both = (
            fused is not None
            and fused.supported(hs, student.w, s_dtype, tuning)
            and fused.supported(ht, teacher.w, t_dtype, tuning)
        )
        via = self.backend if both else None  # partials for both sides or for neither
        xt, t_parts = chunk_logits(ht, teacher.w, teacher.b, opts.teacher, t_dtype, None, via)
        del ht
        xs, s_parts = chunk_logits(hs, student.w, student.b, opts.student, s_dtype, None, via)
        return ShardChunk(hs, xs, xt, partials=(s_parts[:2], t_parts[:2]) if both else None)

    @staticmethod
    def stats(chunk: ShardChunk, label_cols: Tensor, opts: DistillOptions) -> Tensor:
        if chunk.partials is not None:  # each side's log-sum-exp over its tiles' (max, sum)
            return torch.stack([torch.logsumexp(pmax + psum.log(), dim=1) for pmax, psum in chunk.partials])
        from liger_patch.ops.distillation.triton.shard_rows import shard_stats_triton

        return shard_stats_triton(chunk.s, chunk.t, label_cols, opts)

    @staticmethod
    def sums(
        chunk: ShardChunk, stats: dict, label_cols: Tensor, opts: DistillOptions, want_grad: bool
    ) -> Tensor:
        from liger_patch.ops.distillation.triton.shard_rows import shard_sums_triton

        chunk.partials = None
        return shard_sums_triton(chunk.s, chunk.t, stats["lse_s"], stats["lse_t"], opts)

    @staticmethod
    def grad(
        chunk: ShardChunk,
        stats: dict,
        row_sum: Tensor,
        label_cols: Tensor,
        coef: Tensor,
        opts: DistillOptions,
    ) -> Tensor:
        from liger_patch.ops.distillation.triton.shard_rows import shard_grad_triton

        g = grad_view(chunk.s, chunk.hs.dtype)
        shard_grad_triton(chunk.s, chunk.t, g, stats, row_sum, label_cols, coef, opts)
        chunk.s = chunk.t = None
        return g

    def row_bytes(
        self, vocab: int, student: Side, teacher: Side, opts: DistillOptions, want_grad: bool, gathers: bool
    ) -> int:
        """Both logits chunks and their partials, a gradient buffer where it is wider than the
        student's logits (the CPU's fp32 GEMMs), the hidden rows the chunk copies and grad_h's rows."""
        s_bytes = opts.logits_dtype_for(student.hidden.dtype).itemsize
        t_bytes = opts.logits_dtype_for(teacher.hidden.dtype).itemsize
        fused = self._fused(opts)
        parts = 0 if fused is None else 2 * fused.partial_bytes_per_row(vocab, opts.student)
        g_width = student.w.element_size()
        grad = vocab * g_width if want_grad and g_width > s_bytes else 0
        hidden = (2 * student.hidden.shape[1] + teacher.hidden.shape[1]) * max(
            g_width, teacher.w.element_size()
        )
        return vocab * (s_bytes + t_bytes) + parts + grad + hidden


TORCH = _TorchMath()
