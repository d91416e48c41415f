"""The rows a token pass walks: every row of the hidden states, or only the kept ones that an
index lists, in chunks (:class:`Chunk`, :func:`chunks`); what a chunk reads of a whole-length
tensor (a view, or the gathered rows) and of a walked-length one (a view), and how it writes its
rows of a whole-length result (a slice, or a scatter). Both losses walk their tokens this way."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from liger_patch.ops.core.gemm import mm_into


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, stop)`` of the rows the token pass walks: the tensors' own rows, or with
    ``index`` the rows that ``index[start:stop]`` lists."""

    start: int
    stop: int
    index: torch.Tensor | None = None

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The chunk's rows of a whole-length tensor: a view, or a gathered copy."""
        return t[self.start : self.stop] if self.index is None else t.index_select(0, self.index)

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """The chunk's rows of a tensor with one row per walked row (a view)."""
        return t[self.start : self.stop]

    def put(self, dst: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``values`` (one row per chunk row) into the chunk's rows of the whole-length ``dst``."""
        if self.index is None:
            dst[self.start : self.stop] = values
        else:
            dst.index_copy_(0, self.index, values.to(dst.dtype))

    def put_product(self, dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """Write ``a @ b`` into the chunk's rows of the whole-length ``dst``: straight into its
        slice (``gemm.mm_into``), or scattered into the rows ``index`` lists."""
        if self.index is None:
            mm_into(dst[self.start : self.stop], a, b)
        else:
            dst.index_copy_(0, self.index, (a @ b).to(dst.dtype))


def chunks(n_rows: int, index: torch.Tensor | None, chunk_rows: int) -> Iterator[Chunk]:
    """The chunks of ``chunk_rows`` rows (the last one shorter) of the ``n_rows`` rows, or with
    ``index`` of the rows it lists."""
    total = n_rows if index is None else index.shape[0]
    for start in range(0, total, chunk_rows):
        stop = min(start + chunk_rows, total)
        yield Chunk(start, stop, None if index is None else index[start:stop])


def walked(t: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s walked rows: itself, or its ``index`` rows gathered once for the whole pass."""
    return t if t is None or index is None else t.index_select(0, index)
