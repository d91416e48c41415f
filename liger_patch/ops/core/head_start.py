"""The first token chunk's logits GEMM, started before the forward waits for its label check.

A forward waits for its label check only where it expects to skip the ignored rows
(``kept_rows.expects_skip``); the GPU would then idle while the host waits and sets up the chunk
loop: 0.3-0.5 ms a call, 5-11 % of a small head on an H100 (docs/perf-notes.md item 35).
``start`` launches the fused logits GEMM for the first kept rows of the first token chunk
(``nonzero_static``, no sync, gathered), into that chunk's own buffers, after the check's device
work and before its answer is waited for, so the GPU computes while the host waits. If the call
then walks the kept rows with that plan, ``finish`` computes the chunk's other rows into the
same buffers and the chunk goes on as any other: every row's logits come from the same kernel
and tiles, so results are bit for bit those of one launch. Otherwise (the answer says too few
are ignored after all) the buffers are dropped, and the GEMM spent on them (measured: up to 0.4
ms at the smallest heads, item 37) is lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from liger_patch import env
from liger_patch.ops.core.gemm import LogitsGemm

_ROW_ALIGN = 128  # the fused GEMM's row tile on CUDA: each launch covers whole tiles
_INTERPRET_ROW_ALIGN = 16  # its row tile under the interpreter


@dataclass
class HeadStart:
    """The first chunk's buffers (as many rows as it may have) with rows ``[0, done)`` of its
    logits and partials computed over the first kept rows; ``take`` hands them over once."""

    logits: torch.Tensor | None  # (rows, V)
    partials: tuple | None  # (pmax, psum, pz), rows as ``logits``
    done: int

    def fits(self, walks_kept: bool, first_rows: int) -> bool:
        """Whether a token pass, over the kept rows (``walks_kept``) or every row, whose first
        chunk has ``first_rows`` rows begins with the chunk this head began (kept rows only)."""
        return self.logits is not None and walks_kept and first_rows <= self.logits.shape[0]

    def take(self) -> tuple[torch.Tensor, tuple]:
        logits, partials = self.logits, self.partials
        self.logits = self.partials = None  # the caller's now: freed with its chunk
        return logits, partials


def head_rows(gflop: float, hidden_size: int, vocab: int, first_rows: int) -> int:
    """Rows of the first chunk to compute before the sync: about ``gflop`` of logits GEMM,
    in whole row tiles, at most the chunk."""
    if gflop <= 0 or first_rows == 0 or hidden_size * vocab == 0:
        return 0
    align = _INTERPRET_ROW_ALIGN if env.triton_interpret() else _ROW_ALIGN
    rows = math.ceil(gflop * 1e9 / (2 * hidden_size * vocab) / align) * align
    return min(rows, first_rows)


def start(gemm: LogitsGemm, h: torch.Tensor, first: int, keep: torch.Tensor) -> HeadStart | None:
    """Launch the first ``head_rows`` rows (``Tuning.head_start_gflop``) of the token pass's
    first chunk, of at most ``first`` rows, over the rows of ``h`` that ``keep`` (the kept rows'
    mask) keeps, with ``gemm``'s fused logits GEMM; ``None`` when there is nothing to start or
    the GEMM does not take the chunk."""
    w, opts = gemm.w, gemm.opts
    done = head_rows(opts.tuning.head_start_gflop, h.shape[1], w.shape[0], first)
    fused = gemm.fused.fused_logits
    if done == 0 or not fused.supported(h[:first], w, gemm.logits_dtype, opts.tuning):
        return None
    # The first ``done`` kept rows; past the last kept one, row 0 (computed, never used).
    rows = h.index_select(0, torch.nonzero_static(keep, size=done, fill_value=0).view(-1))
    logits = torch.empty(first, w.shape[0], dtype=gemm.logits_dtype, device=h.device)
    partials = fused.new_partials(first, w.shape[0], opts, h.device)
    gemm.logits(rows, logits[:done], _rows(partials, 0, done))
    return HeadStart(logits, partials, done)


def finish(head: HeadStart, gemm: LogitsGemm, h: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The first chunk's logits and partials: the rows ``start`` left, from the chunk's hidden
    rows ``h``, computed into the same buffers (their first ``h.shape[0]`` rows)."""
    logits, partials = head.take()
    rows = h.shape[0]
    logits, partials = logits[:rows], _rows(partials, 0, rows)
    if head.done < rows:
        gemm.logits(h[head.done :], logits[head.done :], _rows(partials, head.done, rows))
    return logits, partials


def _rows(partials: tuple, start: int, stop: int) -> tuple:
    return tuple(None if p is None else p[start:stop] for p in partials)
