"""Logits GEMM that also leaves log-sum-exp partials, so the row kernel needs one pass, not two.

``logits = h W^T (+ b)`` for one token chunk, tiled over (rows, vocabulary) on a persistent grid
that loads its operands through TMA descriptors (Hopper and later). Each tile is rounded to the
logits dtype and stored, exactly as the cuBLAS path stores it; from the same rounded values
(after the logit scale and softcap) the epilogue writes, per row and vocabulary tile, the maximum
and the sum of ``exp(z - max)`` (and the sum of ``z`` for label smoothing). The row kernel folds
these into each row's log-sum-exp instead of reading the whole chunk once more for it.

Measured (docs/perf-notes.md items 19-20): on an H200 this GEMM runs 0.5-3 % slower than
cuBLAS's, and removing the row kernel's first pass more than pays for it: the whole op, A/B
interleaved, gained 0.4-0.9 ms at the four benchmark shapes.

The kernel is compiled on first use for the ``TRITON_INTERPRET`` mode of that moment; under the
interpreter it runs on CPU tensors (fp32 there, as all CPU GEMMs here are).
"""

from __future__ import annotations

import functools
import re

import torch
import triton
import triton.language as tl

from liger_patch import env
from liger_patch.ops.core.final_logits import LogitsOptions
from liger_patch.ops.core.triton.common import ceil_div, jitted, round_bf16_nearest, softcap
from liger_patch.ops.core.tuning import Tuning

Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""(pmax, psum, pz): ``logits_with_partials``' per-tile maxima, sums and (smoothing) logit sums."""

TMA_ALIGN = 16
"""Bytes: TMA needs the operands' bases and row strides aligned to this (``supported``)."""

# On CUDA the tiles (BM, BN, BK, stages, warps) are the call's ``Tuning.logits_tiles``.
# Small tiles under the interpreter, so that test shapes span several tiles in both directions.
_INTERPRET_CONFIG = (16, 32, 16, 1, 1)
_INTERPRET_PROGRAMS = 3
_GROUP_M = 8


def _logits_lse_kernel(
    h_desc,
    w_desc,
    out_desc,
    bias_ptr,
    pmax_ptr,
    psum_ptr,
    pz_ptr,
    M,
    V,
    K,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    ROUND_BF16_NEAREST: tl.constexpr,
    ROUND_FN: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
    SOFTCAP_FN: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(V, BN)
    in_group = GROUP_M * tiles_n
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        # Grouped order: consecutive tiles share W tiles while a few row blocks sweep them (L2).
        first_m = (tile // in_group) * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        off_m = pid_m * BM
        off_n = pid_n * BN

        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            acc = tl.dot(h_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        cols = off_n + tl.arange(0, BN)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)[None, :]
        if ROUND_BF16_NEAREST:  # the interpreter truncates to bf16; cuBLAS rounds to nearest
            acc = ROUND_FN(acc)
        stored = acc.to(out_desc.dtype)
        out_desc.store([off_m, off_n], stored)  # TMA clips the parts past M and V

        z = stored.to(tl.float32)
        if HAS_SCALE:
            z = z * logit_scale
        if HAS_SOFTCAP:
            z, _ = SOFTCAP_FN(z, softcap)  # the row kernel's softcap
        in_vocab = cols[None, :] < V
        z = tl.where(in_vocab, z, float("-inf"))
        tile_max = tl.max(z, axis=1)
        tile_sum = tl.sum(tl.exp(z - tile_max[:, None]), axis=1)
        rows = off_m + tl.arange(0, BM)
        part = rows.to(tl.int64) * tiles_n + pid_n
        tl.store(pmax_ptr + part, tile_max, mask=rows < M)
        tl.store(psum_ptr + part, tile_sum, mask=rows < M)
        if HAS_SMOOTHING:
            tl.store(pz_ptr + part, tl.sum(tl.where(in_vocab, z, 0.0), axis=1), mask=rows < M)


@functools.cache
def _tensor_descriptor():
    """Triton's host-side TMA descriptor class, or None on a Triton without one (or older than
    3.4, whose ``tl.range`` has no ``flatten``)."""
    if tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2]) < (3, 4):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


@functools.cache
def _cuda_fits(device_index: int, tiles: tuple[int, int, int, int, int]) -> bool:
    """TMA (compute capability 9.0+) and enough shared memory per block for the operand stages
    and the output tile (consumer Blackwell, sm_120, has TMA but ~100 KiB)."""
    bm, bn, bk, stages, _ = tiles
    needed = 2 * (stages * (bm + bn) * bk + bm * bn)  # half-precision bytes
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return torch.cuda.get_device_capability(device_index) >= (9, 0) and optin >= needed


@functools.cache
def _sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device, the persistent grid's width: the same at every
    call, and reading the device properties costs host time at every chunk."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _aligned(t: torch.Tensor) -> bool:
    """TMA-loadable: unit column stride, 16-byte aligned base and row stride, rows that do not
    overlap (an expanded operand has row stride 0)."""
    size = t.element_size()
    return (
        t.stride(-1) == 1
        and t.stride(0) >= t.shape[1]
        and t.data_ptr() % TMA_ALIGN == 0
        and (t.stride(0) * size) % TMA_ALIGN == 0
    )


def supported(h: torch.Tensor, w: torch.Tensor, logits_dtype: torch.dtype, tuning: Tuning) -> bool:
    """Whether this path can compute the chunk: TMA hardware (or the interpreter), 16-byte
    aligned rows for the operands and for a contiguous ``rows x V`` output, and, on CUDA, half
    inputs with logits in the same dtype (fp32 inputs would run as TF32 here, and an fp32 output
    tile does not fit in shared memory next to the operand stages)."""
    if not tuning.fused_logits or _tensor_descriptor() is None or h.dtype != w.dtype or h.shape[1] == 0:
        return False
    if (w.shape[0] * logits_dtype.itemsize) % TMA_ALIGN:
        return False
    if not (_aligned(h) and _aligned(w)):
        return False
    if env.triton_interpret():
        return h.device.type == "cpu"
    return (
        h.is_cuda
        and h.dtype in (torch.bfloat16, torch.float16)
        and logits_dtype == h.dtype
        and _cuda_fits(
            h.device.index if h.device.index is not None else torch.cuda.current_device(), tuning.logits_tiles
        )
    )


def _tiles(tuning: Tuning, interpret: bool) -> tuple[int, int, int, int, int]:
    return _INTERPRET_CONFIG if interpret else tuning.logits_tiles


def partial_bytes_per_row(vocab: int, opts: LogitsOptions) -> int:
    """Bytes of partials ``logits_with_partials`` allocates per row (about V/32 on CUDA, 1/64
    of a half-precision logits row), which the caller's memory budget must cover."""
    bn = _tiles(opts.tuning, env.triton_interpret())[1]
    return ceil_div(vocab, bn) * 4 * (3 if opts.label_smoothing != 0.0 else 2)


def new_partials(
    rows: int, vocab: int, opts: LogitsOptions, device: torch.device, interpret: bool | None = None
) -> Partials:
    """Empty partials for ``rows`` rows (``logits_with_partials`` fills them); ``interpret``: the
    ``TRITON_INTERPRET`` mode the caller read, else read now."""
    interpret = env.triton_interpret() if interpret is None else interpret
    tiles_n = ceil_div(vocab, _tiles(opts.tuning, interpret)[1])
    pmax = torch.empty(rows, tiles_n, dtype=torch.float32, device=device)
    pz = torch.empty_like(pmax) if opts.label_smoothing != 0.0 else None
    return pmax, torch.empty_like(pmax), pz


def logits_with_partials(
    h: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LogitsOptions,
    out: torch.Tensor,
    partials: Partials | None = None,
) -> Partials:
    """Write ``h w^T + bias`` into ``out`` (rows x V, contiguous) and return the partials.

    Returns ``(pmax, psum, pz)``, each (rows, tiles) fp32: per vocabulary tile of each row, the
    max of the transformed logits ``z``, the sum of ``exp(z - max)``, and (label smoothing only,
    else ``None``) the sum of ``z``; written into ``partials`` when given (``new_partials``'
    buffers, or rows of them), else new. ``bias`` must already be in the dtype whose values the
    cuBLAS path adds (see ``gemm``). Call only where ``supported`` says so.
    """
    rows, k = h.shape
    vocab = w.shape[0]
    interpret = env.triton_interpret()
    bm, bn, bk, stages, warps = _tiles(opts.tuning, interpret)
    tiles_n = ceil_div(vocab, bn)
    if partials is None:
        partials = new_partials(rows, vocab, opts, h.device, interpret)
    elif partials[0].shape != (rows, tiles_n) or not all(p.is_contiguous() for p in partials[:2]):
        raise ValueError(f"partials must be contiguous ({rows}, {tiles_n}); got {tuple(partials[0].shape)}")
    pmax, psum, pz = partials
    smoothing = opts.label_smoothing != 0.0
    n_tiles = ceil_div(rows, bm) * tiles_n
    if n_tiles == 0:
        return pmax, psum, pz
    programs = min(_INTERPRET_PROGRAMS if interpret else _sm_count(h.device.index), n_tiles)
    descriptor = _tensor_descriptor()
    round_nearest = interpret and out.dtype == torch.bfloat16
    jitted(_logits_lse_kernel, interpret)[(programs,)](
        descriptor.from_tensor(h, [bm, bk]),
        descriptor.from_tensor(w, [bn, bk]),
        descriptor(out, [rows, vocab], [out.stride(0), 1], [bm, bn]),
        bias if bias is not None else pmax,
        pmax,
        psum,
        pz if pz is not None else pmax,
        rows,
        vocab,
        k,
        opts.scale,
        float(opts.softcap or 1.0),
        HAS_BIAS=bias is not None,
        HAS_SCALE=opts.logit_scale is not None,
        HAS_SOFTCAP=opts.softcap is not None,
        HAS_SMOOTHING=smoothing,
        ROUND_BF16_NEAREST=round_nearest,
        # Jitted functions as constexprs cost host time at every launch: passed only when used.
        ROUND_FN=jitted(round_bf16_nearest, interpret) if round_nearest else None,
        BM=bm,
        BN=bn,
        BK=bk,
        GROUP_M=_GROUP_M,
        PROGRAMS=programs,
        SOFTCAP_FN=jitted(softcap, interpret) if opts.softcap is not None else None,
        num_stages=stages,
        num_warps=warps,
    )
    return pmax, psum, pz
