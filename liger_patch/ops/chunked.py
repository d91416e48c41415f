"""The token-chunk loop shared by every backend: three GEMMs around one row kernel per chunk.

For each chunk of rows: ``logits = h W^T + b`` in fp32 (the only ``rows x V`` buffer), the
backend's row kernel turns it into loss terms and, in place, into d(loss)/d(logits); then
``grad_h = g W`` (written straight into its slice, no accumulation) and ``grad_W += g^T h``
(accumulated in fp32). The full ``tokens x V`` logits never exist.

GEMM operands stay in the input dtype on CUDA (tensor cores, fp32 accumulation, fp32 logits
output) and are fp32 on CPU, where half-precision matmuls are slow and less exact.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liger_patch.ops.options import LossOptions

RowKernel = Callable[..., tuple[torch.Tensor | None, torch.Tensor]]


@dataclass
class ChunkResult:
    ce: torch.Tensor | None
    lse: torch.Tensor | None
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    grad_bias: torch.Tensor | None


def chunk_rows(vocab: int, budget_bytes: int, element_bytes: int = 4) -> int:
    """Rows per chunk so that the logits chunk fits ``budget_bytes``."""
    rows = max(1, budget_bytes // (element_bytes * max(vocab, 1)))
    return rows - rows % 128 if rows >= 256 else rows


def _gemm_dtype(t: torch.Tensor) -> torch.dtype:
    return t.dtype if t.is_cuda else torch.float32


@functools.cache
def _has_out_dtype_mm(device_type: str) -> bool:
    """Whether this torch build has ``mm(..., out_dtype=float32)`` for half inputs on the device."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _logits(h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``h w^T + b`` (bias in fp32) stored in ``dtype``.

    The GEMM always accumulates in fp32; ``dtype`` only decides how the chunk is stored: fp32, or
    rounded once to the input's half dtype, as an unpatched half-precision head stores it.
    """
    if h.dtype == dtype:  # CUDA, half logits: the GEMM rounds on store
        return h @ w.t() if bias is None else torch.addmm(bias.to(dtype), h, w.t())
    if h.dtype == torch.float32:  # fp32 inputs, or the CPU, which runs its GEMMs in fp32
        out = h @ w.t()
    elif _has_out_dtype_mm(h.device.type):
        out = torch.mm(h, w.t(), out_dtype=torch.float32)
    else:
        out = (h @ w.t()).float()
    if bias is not None:
        out += bias
    return out.to(dtype)


def _accumulate_grad_weight(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """``acc (+)= g^T h``; ``first`` overwrites instead of adding (no zero-fill needed)."""
    if g.dtype == acc.dtype:
        if first:
            torch.mm(g.t(), h, out=acc)
        else:
            acc.addmm_(g.t(), h)
    elif acc.dtype == torch.float32 and _has_out_dtype_mm(g.device.type):
        torch.addmm(acc, g.t(), h, out_dtype=acc.dtype, out=acc)
    elif first:
        acc.copy_(g.t() @ h)
    else:
        acc.add_(g.t() @ h)


def _grad_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the row kernel writes d(loss)/d(logits): the logits' own elements when the dtypes
    match, a narrower view of the logits' bytes whose row r starts where logits row r starts
    (fp32 logits, half gradients), or a new buffer when the gradient is wider (half logits on
    the CPU, whose GEMMs run in fp32). The row kernel writes every element."""
    if dtype == logits.dtype:
        return logits
    if logits.element_size() > torch.empty((), dtype=dtype).element_size():
        return logits.view(dtype)[:, : logits.shape[1]]
    return torch.empty(logits.shape, dtype=dtype, device=logits.device)


@torch.no_grad()  # gradients are computed by hand here; autograd must not track the chunk GEMMs
def run_chunks(
    row_kernel: RowKernel,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    opts: LossOptions,
    *,
    budget_bytes: int,
    coef_ce: torch.Tensor | None = None,
    coef_z: torch.Tensor | None = None,
    lse_in: torch.Tensor | None = None,
    need_hidden: bool = False,
    need_weight: bool = False,
    need_bias: bool = False,
    fp32_grad_weight: bool | None = None,
    logits_in_input_dtype: bool = False,
) -> ChunkResult:
    """Loss terms for every row of ``hidden`` (N, H), and gradients when coefficients are given.

    ``coef_ce``/``coef_z`` (N,) fp32 weight each row's d ce/dz and d z-term/dz; they are zero at
    ignored rows. Gradients come back in the dtypes of their inputs.

    ``grad_W`` sums one GEMM per chunk. Each GEMM accumulates in fp32; across chunks the sum is
    kept in fp32 when the weight is fp32, on CPU, or when an fp32 copy of ``grad_W`` fits in
    ``budget_bytes`` (``fp32_grad_weight=None``); otherwise it is accumulated in the weight's
    own dtype (one rounding per chunk) so that the extra memory stays within the budget.

    ``logits_in_input_dtype`` stores each logits chunk in ``hidden``'s dtype instead of fp32: for
    bf16/fp16 inputs half the bytes, so twice the rows per chunk, at the precision of an unpatched
    half-precision head. Every reduction stays fp32.
    """
    n_rows = hidden.shape[0]
    vocab = weight.shape[0]
    device = hidden.device
    compute_grad = coef_ce is not None and (need_hidden or need_weight or need_bias)
    gemm_dtype = _gemm_dtype(hidden)
    w = weight.to(gemm_dtype)
    b = None if bias is None else bias.float()

    ce = lse = None
    if lse_in is None:
        ce = torch.empty(n_rows, dtype=torch.float32, device=device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    grad_hidden = torch.empty_like(hidden) if compute_grad and need_hidden else None
    if fp32_grad_weight is None:
        fp32_grad_weight = gemm_dtype == torch.float32 or 4 * weight.numel() <= budget_bytes
    acc_dtype = torch.float32 if fp32_grad_weight else weight.dtype
    # The first chunk's GEMM overwrites a weight-dtype accumulator; an fp32 one is added into.
    overwrite_first = acc_dtype != torch.float32 and n_rows > 0
    alloc = torch.empty if overwrite_first else torch.zeros
    grad_weight = None
    if compute_grad and need_weight:
        grad_weight = alloc(weight.shape, dtype=acc_dtype, device=device)
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if compute_grad and need_bias else None

    logits_dtype = hidden.dtype if logits_in_input_dtype else torch.float32
    step = chunk_rows(vocab, budget_bytes, torch.empty((), dtype=logits_dtype).element_size())
    for start in range(0, n_rows, step):
        first = start == 0
        stop = min(start + step, n_rows)
        h = hidden[start:stop].to(gemm_dtype)
        logits = _logits(h, w, b, logits_dtype)
        g = _grad_view(logits, gemm_dtype) if compute_grad else None
        ce_c, lse_c = row_kernel(
            logits,
            labels[start:stop],
            opts,
            grad=g,
            coef_ce=None if coef_ce is None else coef_ce[start:stop],
            coef_z=None if coef_z is None else coef_z[start:stop],
            lse_in=None if lse_in is None else lse_in[start:stop],
        )
        if ce is not None:
            ce[start:stop] = ce_c
            lse[start:stop] = lse_c
        if g is None:
            continue
        if grad_hidden is not None:
            if gemm_dtype == grad_hidden.dtype:
                torch.mm(g, w, out=grad_hidden[start:stop])
            else:
                grad_hidden[start:stop] = g @ w
        if grad_weight is not None:
            _accumulate_grad_weight(grad_weight, g, h, first and overwrite_first)
        if grad_bias is not None:
            grad_bias += g.sum(dim=0, dtype=torch.float32)
        del logits, g

    return ChunkResult(
        ce=ce,
        lse=lse,
        grad_hidden=grad_hidden,
        grad_weight=None if grad_weight is None else grad_weight.to(weight.dtype),
        grad_bias=None if grad_bias is None else grad_bias.to(bias.dtype),
    )
