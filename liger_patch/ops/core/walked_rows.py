"""The rows a token pass walks: every row of the hidden states, or only the kept ones that
``run_chunks``'s ``row_index`` lists, in chunks (:class:`Chunk`), and the row kernel's per-row
records for those rows (:class:`RowRecords`), gathered or scattered once per call."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from liger_patch.ops.cross_entropy.row_io import ClassWeight, EntropyGrad, RowOutputs


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


def walked(t: torch.Tensor | None, index: torch.Tensor | None) -> torch.Tensor | None:
    """``t``'s walked rows: itself, or its ``index`` rows gathered once for the whole pass."""
    return t if t is None or index is None else t.index_select(0, index)


@dataclass(frozen=True)
class RowRecords:
    """The row kernel's extra records of one call (``row_io``), with one row per walked row, and
    ``index``: the rows the token pass walks (``run_chunks``'s ``row_index``), ``None`` for every
    row. With ``index`` the per-row records are gathered once (``entropy_grad``) or written into
    walked-length buffers (``outputs``) that :meth:`finish` scatters into the caller's
    whole-length ``scatter_to``: a few launches per call instead of per chunk."""

    class_weight: ClassWeight | None
    outputs: RowOutputs | None
    entropy_grad: EntropyGrad | None
    index: torch.Tensor | None = None
    scatter_to: RowOutputs | None = None

    @classmethod
    def walking(
        cls,
        class_weight: ClassWeight | None,
        outputs: RowOutputs | None,
        entropy_grad: EntropyGrad | None,
        index: torch.Tensor | None,
    ) -> RowRecords:
        if index is None:
            return cls(class_weight, outputs if outputs is not None and outputs.any() else None, entropy_grad)
        walked_outputs = None
        if outputs is not None and outputs.any():
            n = index.shape[0]
            walked_outputs = RowOutputs(*(None if t is None else t.new_empty(n) for t in outputs.tensors()))
        grad = None
        if entropy_grad is not None:
            grad = EntropyGrad(walked(entropy_grad.coef, index), walked(entropy_grad.entropy, index))
        return cls(class_weight, walked_outputs, grad, index, outputs if walked_outputs is not None else None)

    def chunks(self, n_rows: int, chunk_rows: int) -> Iterator[Chunk]:
        """The token pass's chunks of ``chunk_rows`` rows: of all ``n_rows``, or of ``index``."""
        total = n_rows if self.index is None else self.index.shape[0]
        for start in range(0, total, chunk_rows):
            stop = min(start + chunk_rows, total)
            yield Chunk(start, stop, None if self.index is None else self.index[start:stop])

    def for_chunk(self, chunk: Chunk) -> dict:
        """Keyword arguments of the row kernel for ``chunk`` (views of the walked records)."""
        out = {}
        if self.class_weight is not None:
            out["class_weight"] = self.class_weight
        if self.outputs is not None:
            out["outputs"] = self.outputs.rows(chunk.start, chunk.stop)
        if self.entropy_grad is not None:
            grad = self.entropy_grad
            out["entropy_grad"] = EntropyGrad(chunk.rows(grad.coef), chunk.rows(grad.entropy))
        return out

    def finish(self) -> None:
        """Write the walked outputs into the caller's; the rows not walked get an ignored row's
        value (row_io: 0, -1 for argmax)."""
        if self.scatter_to is None:
            return
        for dst, values in zip(self.scatter_to.tensors(), self.outputs.tensors(), strict=True):
            if dst is not None:
                dst.fill_(-1 if dst is self.scatter_to.argmax else 0)
                dst.index_copy_(0, self.index, values.to(dst.dtype))
