"""A low-rank term on the logits: ``h W^T + b + u B^T``, never ``W + B A`` itself.

A LoRA adapter on the output head turns its logits into ``h (W + s B A)^T = h W^T + u B^T`` with
``u = s A dropout(h)`` (tokens x r). The caller computes ``u`` with ordinary autograd (the
adapter's own modules: dropout, scaling, several adapters concatenated along r); the op takes
``(u, B)`` and adds ``u_chunk B^T`` to each logits chunk (one GEMM of rank r), so no
``V x H`` copy of the effective weight exists. From a chunk's d(loss)/d(logits) ``g`` it returns
``grad_u = g B`` (the chunk's rows) and ``grad_B = sum over chunks of g^T u_chunk`` (fp32 sum).
grad_W, the base weight's gradient, is computed only if the base weight wants one (under LoRA it
normally does not, and then no ``V x H`` buffer is made at all).

``u`` follows the hidden states' dtype rules and ``B`` the weight's: both run in the GEMMs'
dtype (``gemm.gemm_dtype_for``), and their gradients come back in their own dtypes. The term is
added to the logits as stored (``logits_dtype``), before the row kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from liger_patch.ops.core.grad_weight_layout import accumulate_grad_weight
from liger_patch.ops.core.walked_rows import Chunk


def check_low_rank(hidden: torch.Tensor, weight: torch.Tensor, u: torch.Tensor, b: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``u`` is (..., r) with ``hidden``'s leading shape and ``b`` is
    (V, r), both floating point on ``hidden``'s device."""
    problems = []
    if u.shape[:-1] != hidden.shape[:-1] or u.dim() != hidden.dim():
        problems.append(
            f"u {tuple(u.shape)} must have the hidden states' leading shape {tuple(hidden.shape[:-1])}"
        )
    if b.dim() != 2 or b.shape[0] != weight.shape[0] or b.shape[1] != u.shape[-1]:
        problems.append(f"B {tuple(b.shape)} must be (vocab {weight.shape[0]}, rank {u.shape[-1]})")
    for name, t in (("u", u), ("B", b)):
        if not t.is_floating_point() or t.device != hidden.device:
            problems.append(f"{name} must be floating point on {hidden.device} (is {t.dtype} on {t.device})")
    if problems:
        raise ValueError("liger_patch: low-rank term: " + "; ".join(problems))


@dataclass
class LowRank:
    """The term of one ``run_chunks`` call: ``u`` (N, r) as given, ``b`` (V, r) in the GEMMs'
    dtype, and the gradients the chunks fill: ``grad_u`` (N, r, in u's dtype; zeros first where
    the pass skips rows, which get none) and ``grad_b`` (V, r, the fp32 sum)."""

    u: torch.Tensor
    b: torch.Tensor
    b_dtype: torch.dtype
    grad_u: torch.Tensor | None
    grad_b: torch.Tensor | None

    @classmethod
    def of(
        cls,
        term: tuple[torch.Tensor, torch.Tensor] | None,
        gemm_dtype: torch.dtype,
        needs: tuple[bool, bool],
        skips_rows: bool,
    ) -> LowRank | None:
        """The record for ``term`` (``(u, B)`` or ``None``), with buffers for the gradients ``needs``
        asks for (of u, of B)."""
        if term is None:
            return None
        u, b = term
        new = torch.zeros if skips_rows else torch.empty
        grad_u = new(u.shape, dtype=u.dtype, device=u.device) if needs[0] else None
        grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if needs[1] else None
        return cls(u, b.to(gemm_dtype), b.dtype, grad_u, grad_b)

    @property
    def wants_grads(self) -> bool:
        return self.grad_u is not None or self.grad_b is not None

    def rows(self, chunk: Chunk | None) -> torch.Tensor:
        """u's rows of ``chunk`` (every row for ``None``) in the GEMMs' dtype."""
        return (self.u if chunk is None else chunk.take(self.u)).to(self.b.dtype)

    def add_to(self, logits: torch.Tensor, u: torch.Tensor, cols: slice | None = None) -> None:
        """``logits += u B[cols]^T`` in place (in the logits' dtype, accumulated in fp32)."""
        b = self.b if cols is None else self.b[cols]
        if logits.dtype == u.dtype:
            logits.addmm_(u, b.t())
        else:
            logits.add_(u @ b.t())

    def chunk_grads(self, chunk: Chunk, u: torch.Tensor, g: torch.Tensor) -> None:
        """From the chunk's d(loss)/d(logits) ``g``: grad_u's rows ``g B`` and grad_B ``+= g^T u``."""
        if self.grad_u is not None:
            chunk.put_product(self.grad_u, g, self.b)
        if self.grad_b is not None:
            accumulate_grad_weight(self.grad_b, g, u, first=False)

    def results(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """grad_u and grad_B (in B's dtype)."""
        return self.grad_u, None if self.grad_b is None else self.grad_b.to(self.b_dtype)
