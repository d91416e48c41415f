"""Where a token pass adds up a head's gradients, chunk by chunk, from each chunk's gradient with
respect to its raw logits ``g``: grad_h's rows ``g W`` (each chunk writes its own rows), the grad_W
sum ``g^T h`` and grad_b's fp32 sum of ``g``. Both losses' chunk loops add their chunks here."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_patch.ops.core.grad_weight_layout import accumulate_grad_weight
from liger_patch.ops.core.walked_rows import Chunk


@dataclass
class GradSums:
    """A head's gradient buffers, each ``None`` where not wanted: ``hidden`` (N, H), ``weight``
    (V, H; where grad_W is summed, in fp32 or a narrower dtype) and ``bias`` (V,) fp32. With
    ``overwrite_first`` the first chunk (rows from 0) writes the grad_W sum instead of adding to
    it, so that it needs no zeros first."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    overwrite_first: bool = False

    def add(
        self, chunk: Chunk, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, *, weight_too: bool = True
    ) -> None:
        """One chunk's share, from ``g`` (rows, V) and the chunk's hidden rows ``h`` and weight
        ``w`` as the GEMMs read them (``g`` is cast to ``w``'s dtype for the GEMMs; grad_b sums
        it as given). Without ``weight_too`` only grad_h's rows (grad_W and grad_b come from
        another pass)."""
        g_gemm = g.to(w.dtype)
        if self.hidden is not None:
            chunk.put_product(self.hidden, g_gemm, w)
        if not weight_too:
            return
        if self.weight is not None:
            accumulate_grad_weight(self.weight, g_gemm, h, self.overwrite_first and chunk.start == 0)
        if self.bias is not None:
            self.bias += g.sum(dim=0, dtype=torch.float32)
