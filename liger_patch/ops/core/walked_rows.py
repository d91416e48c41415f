"""The rows a token pass walks: every row of the hidden states, or only the kept ones that an
index lists, in chunks (:class:`Chunk`); what a chunk reads of a whole-length tensor (a view, or
the gathered rows) and of a walked-length one (a view)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
