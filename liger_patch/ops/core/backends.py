"""Backends as records: what each provides, whether it can run here, and which one a call gets.

What every loss takes from a backend (each loss adds its own row math: the cross-entropy's
``cross_entropy/backends.py``, the distillation's chunk math in ``distillation/operator.py``):

* ``scale_``: multiplies the gradients the forward precomputed by the upstream gradient, in place;
* ``fused_logits``: a logits GEMM that also leaves log-sum-exp partials for the row kernel, or
  ``None`` (then cuBLAS computes every chunk's logits);
* ``unavailable(device)``: why it cannot run on a device (an exception to raise), or ``None``;
* ``label_check``: a forward's label bookkeeping in one launch (``kept_rows.FusedCheck``), or
  ``None`` (then ``kept_rows`` does it with PyTorch ops).

The Triton record imports Triton only when it is first asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from liger_patch import env

_SCALE_SLICE = 1 << 22
"""Elements scaled per step by ``scale_in_fp32_`` (a 16 MiB fp32 temporary)."""


def scale_in_fp32_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply contiguous tensors in place by the 0-d fp32 ``scale``: the fp32 product rounded
    once, as the Triton scaling kernel does. (``mul_`` of a bf16 tensor by a 0-d CUDA tensor
    rounds the scale to bf16 first: 0.37 became 0.3691, a bias of up to 0.4 %.)"""
    for t in tensors:
        if t.dtype == torch.float32:
            t.mul_(scale)
            continue
        flat = t.view(-1)
        for start in range(0, flat.numel(), _SCALE_SLICE):
            part = flat[start : start + _SCALE_SLICE]
            part.copy_(part.float().mul_(scale))


@dataclass(frozen=True)
class FusedLogits:
    """A logits GEMM that leaves per-tile log-sum-exp partials (``triton/logits.py``).

    ``supported(h, w, logits_dtype, tuning)`` says whether it can compute a chunk (``align``: the
    bytes to which it needs the operands' bases and row strides aligned);
    ``partial_bytes_per_row(vocab, opts)`` is what its partials add to the chunk's memory;
    ``logits_with_partials(h, w, bias, opts, out, partials=None)`` writes the logits into ``out``
    and returns the partials the row kernel takes as ``partials=`` (written into ``partials``
    when given: ``new_partials(rows, vocab, opts, device)``'s buffers, or rows of them).
    """

    supported: Callable[..., bool]
    partial_bytes_per_row: Callable[..., int]
    logits_with_partials: Callable[..., tuple]
    new_partials: Callable[..., tuple]
    align: int


@dataclass(frozen=True)
class Backend:
    """One backend: its name (as ``backend=`` names it) and what it provides."""

    name: str
    scale_: Callable[[list[torch.Tensor], torch.Tensor], None]
    fused_logits: FusedLogits | None
    unavailable: Callable[[torch.device], Exception | None]
    label_check: Callable[..., object] | None


TORCH = Backend(
    name="torch",
    scale_=scale_in_fp32_,
    fused_logits=None,
    unavailable=lambda device: None,
    label_check=None,
)


@functools.cache  # asked at every call; an installation does not change within a process
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_unavailable(device: torch.device) -> Exception | None:
    if not _triton_installed():
        return RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
    if device.type != "cuda" and not env.triton_interpret():
        return ValueError(
            f"backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 for tensors on {device.type}; "
            "use backend='torch' or 'auto'"
        )
    return None


@functools.cache
def _triton() -> Backend:
    """The Triton record (imports Triton and compiles nothing yet)."""
    from liger_patch.ops.core.triton import label_check, logits, scale

    return Backend(
        name="triton",
        scale_=scale.scale_,
        fused_logits=FusedLogits(
            logits.supported,
            logits.partial_bytes_per_row,
            logits.logits_with_partials,
            logits.new_partials,
            logits.TMA_ALIGN,
        ),
        unavailable=_triton_unavailable,
        label_check=label_check.label_check,
    )


def pick(name: str, device: torch.device) -> Backend:
    """The backend a call runs: ``name`` itself (raising why when it cannot run on ``device``), or
    for ``"auto"`` Triton where it can run (CUDA, or ``TRITON_INTERPRET=1``), else torch."""
    if name == "torch":
        return TORCH
    if name == "auto":
        return _triton() if _triton_unavailable(device) is None else TORCH
    if name != "triton":
        raise ValueError(f"unknown backend {name!r}; expected 'auto', 'triton' or 'torch'")
    problem = _triton_unavailable(device)
    if problem is not None:
        raise problem
    return _triton()
