"""The chunk loops' GEMMs in the dtypes they run in.

Operands stay in the input dtype on CUDA (tensor cores, fp32 accumulation) and are fp32 on the
CPU, where half-precision matmuls are slow and less exact (``gemm_dtype_for``). Every GEMM
accumulates in fp32; what differs is the dtype it stores: the logits chunk in ``logits_dtype``
(``gemm_logits``, or the backend's fused logits GEMM through ``chunk_logits``), a product into a
buffer of another width (``mm_into``), and the row kernel's gradient in the logits' own bytes
(``grad_view``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from liger_patch.ops.core.backends import Backend
from liger_patch.ops.core.final_logits import LogitsOptions


def gemm_dtype_for(t: torch.Tensor) -> torch.dtype:
    """The GEMMs' operand dtype for inputs like ``t``: its own on CUDA (tensor cores), fp32 on the
    CPU, where half-precision matmuls are slow and less exact."""
    return t.dtype if t.is_cuda else torch.float32


@functools.cache
def has_out_dtype_mm(device_type: str) -> bool:
    """Whether this torch build has ``mm(..., out_dtype=float32)`` for half inputs on the device."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(2, 2, dtype=torch.float32, device=device_type)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _bias_as_added(
    bias: torch.Tensor | None, gemm_dtype: torch.dtype, dtype: torch.dtype
) -> torch.Tensor | None:
    """The fp32 bias as the logits GEMM adds it: rounded to the logits dtype when the GEMM stores
    that dtype itself (cuBLAS's epilogue adds a bias of the output's dtype), else unrounded."""
    if bias is None:
        return None
    return bias.to(dtype) if gemm_dtype == dtype else bias


def gemm_logits(
    h: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``h w^T + b`` (bias in fp32) stored in ``dtype``, into ``out`` when given.

    The GEMM always accumulates in fp32; ``dtype`` only decides how the chunk is stored: rounded
    once to the input's half dtype, as an unpatched half-precision head stores it, or fp32.
    """
    if h.dtype == dtype:  # the GEMM rounds on store (half logits on CUDA, or fp32 everything)
        if bias is None:
            return torch.mm(h, w.t(), out=out) if out is not None else h @ w.t()
        b = _bias_as_added(bias, h.dtype, dtype)
        return torch.addmm(b, h, w.t(), out=out) if out is not None else torch.addmm(b, h, w.t())
    if h.dtype == torch.float32:  # the CPU, which runs its GEMMs in fp32
        res = h @ w.t()
    elif has_out_dtype_mm(h.device.type):
        if out is not None and bias is None:
            return torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
        res = torch.mm(h, w.t(), out_dtype=torch.float32)
    else:
        res = (h @ w.t()).float()
    if bias is not None:
        res += bias
    if out is None:
        return res.to(dtype)
    return out.copy_(res)


def chunk_logits(
    h: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    opts: LogitsOptions,
    dtype: torch.dtype,
    out: torch.Tensor | None,
    backend: Backend | None,
    partials: tuple | None = None,
) -> tuple[torch.Tensor, tuple | None]:
    """A token chunk's logits and, where ``backend``'s fused logits GEMM supports the chunk, the
    log-sum-exp partials it leaves for the row kernel (in ``partials`` when given); else
    ``gemm_logits`` and ``None``."""
    fused = backend.fused_logits if backend is not None else None
    if fused is not None and fused.supported(h, w, dtype, opts.tuning):
        if out is None:
            out = torch.empty(h.shape[0], w.shape[0], dtype=dtype, device=h.device)
        bias = _bias_as_added(b, h.dtype, dtype)
        return out, fused.logits_with_partials(h, w, bias, opts, out, partials)
    return gemm_logits(h, w, b, dtype, out=out), None


@dataclass(frozen=True)
class LogitsGemm:
    """How a pass computes its chunks' logits (``chunk_logits``): the weight ``w`` as the GEMMs
    read it, the fp32 bias ``b``, the options (logit scale, softcap, tuning), the dtype the logits
    are stored in, and the backend whose fused logits GEMM may leave log-sum-exp partials
    (``None``: cuBLAS for every chunk)."""

    w: torch.Tensor
    b: torch.Tensor | None
    opts: LogitsOptions
    logits_dtype: torch.dtype
    fused: Backend | None

    def logits(
        self, h: torch.Tensor, out: torch.Tensor | None = None, partials: tuple | None = None
    ) -> tuple[torch.Tensor, tuple | None]:
        """The logits of the hidden rows ``h`` and their partials, or ``None`` (``chunk_logits``)."""
        return chunk_logits(h, self.w, self.b, self.opts, self.logits_dtype, out, self.fused, partials)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``out = a @ b``, written straight into ``out`` when the dtypes match (CUDA) or an fp32
    ``out`` takes half operands' fp32 accumulator (pass B's grad_W under autocast), else rounded
    into it from the product (CPU, whose GEMMs run in fp32)."""
    if a.dtype == out.dtype:
        torch.mm(a, b, out=out)
    elif out.dtype == torch.float32 and a.dtype.itemsize == 2 and has_out_dtype_mm(a.device.type):
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        out.copy_(a @ b)


def grad_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the row kernel writes d(loss)/d(logits): the logits' own elements when the dtypes
    match, a narrower view of the logits' bytes whose row r starts where logits row r starts
    (fp32 logits, half gradients), or a new buffer when the gradient is wider (half logits on
    the CPU, whose GEMMs run in fp32). The row kernel writes every element."""
    if dtype == logits.dtype:
        return logits
    if logits.element_size() > dtype.itemsize:
        return logits.view(dtype)[:, : logits.shape[1]]
    return torch.empty(logits.shape, dtype=dtype, device=logits.device)
