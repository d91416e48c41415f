"""What the Triton kernels share: jitting for the current mode, the host's integer helpers of a
launch (grids, block sizes), the softcap, bf16 rounding, a logarithm through the SFU, and the fold
of the logits GEMM's log-sum-exp partials."""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language.extra import libdevice

from liger_patch import env


@functools.lru_cache(maxsize=64)
def _jit(fn, interpret: bool):
    del interpret  # part of the cache key only: Triton reads TRITON_INTERPRET when jitting
    return triton.jit(fn)


def jitted(fn, interpret: bool | None = None):
    """``fn`` jitted for the ``TRITON_INTERPRET`` mode of this moment (read on every call, unless
    the caller read it for this launch already and passes it), so one process can run a kernel on
    CUDA and, under the interpreter, on CPU tensors."""
    return _jit(fn, env.triton_interpret() if interpret is None else interpret)


def ceil_div(a: int, b: int) -> int:
    """``triton.cdiv`` for the host, for ``b`` > 0 (block sizes): Triton's is a
    ``constexpr_function``, whose wrapper unwraps every argument at each call (host time at every
    launch; docs/perf-notes.md item 60)."""
    return -(-a // b)


def pow2_at_least(n: int) -> int:
    """``triton.next_power_of_2`` for the host (the same values, 0 for ``n`` <= 0), without its
    ``constexpr_function`` wrapper (see ``ceil_div``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def sfu_log(x):
    """Natural log by the SFU: ``lg2.approx`` times ln 2, absolute error under 2^-21.4 on
    [0.5, 2]. ``tl.log`` compiles to a software logarithm of about 20 instructions, which kept the
    distillation row kernel's mixture instruction-bound (docs/perf-notes.md item 43)."""
    return libdevice.fast_logf(x)


def ieee_log(x):
    """``tl.log``: what ``per_element_log`` gives under the interpreter, which has no libdevice."""
    return tl.log(x)


def per_element_log():
    """The jitted log for a kernel's per-element terms (arguments in [0.5, 2]): ``sfu_log`` on a
    GPU, ``ieee_log`` under the interpreter. Kernels take it as the constexpr ``LOG_FN``."""
    return jitted(ieee_log) if env.triton_interpret() else jitted(sfu_log)


def softcap(x, cap):
    """``cap * tanh(x / cap)`` and its derivative ``1 - tanh(x / cap)^2``, to fp32 accuracy.

    Both come from ``e = exp(-2|u|)``, u = x / cap: tanh = (1 - e) / (1 + e), and below
    |u| = 1/4, where 1 - e cancels, the odd Taylor series to u^11 (next term < 3e-10 relative);
    1 - tanh^2 = 4e / (1 + e)^2, which does not cancel near |tanh| = 1. (``2 sigmoid(2u) - 1``,
    used before, was up to 2e-3 off relative to tanh for small u.) Kernels take it as the
    constexpr argument ``SOFTCAP_FN=jitted(softcap)``.
    """
    u = x / cap
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    u2 = u * u
    series = u2 * (
        -0.3333333333333333
        + u2
        * (
            0.13333333333333333
            + u2 * (-0.05396825396825397 + u2 * (0.021869488536155203 - u2 * 0.008863235529902197))
        )
    )
    r = 1.0 / (1.0 + e)  # one division for both results
    t = tl.where(a < 0.25, a + a * series, (1.0 - e) * r)
    t = tl.where(u < 0.0, -t, t)
    return cap * t, 4.0 * e * r * r


def round_bf16_nearest(x):
    """fp32 values rounded to the nearest bf16 (ties to even), still as fp32. Triton's interpreter
    narrows fp32 to bf16 by truncation (a bias toward zero); the GPU rounds to nearest even.
    Rounding the bits first makes the interpreter's truncation exact. Passed as the constexpr
    ``ROUND_FN=jitted(round_bf16_nearest)`` to kernels that store bf16 under the interpreter."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def fold_partials(pmax_ptr, psum_ptr, pz_ptr, row, n_parts, BLOCK_P: tl.constexpr, WITH_Z: tl.constexpr):
    """(max, log-sum-exp, sum z) of one row from its per-tile partials as the logits GEMM leaves
    them (``triton/logits.py``): (max, sum exp(a - max)) and, ``WITH_Z`` (label smoothing), the
    sum of the row's logits, else 0 (``pz_ptr`` unread). Both losses' row kernels take it as the
    constexpr ``FOLD_FN=jitted(fold_partials)``."""
    run_max = tl.zeros([], dtype=tl.float32) - float("inf")
    run_sum = tl.zeros([], dtype=tl.float32)
    z_total = tl.zeros([], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK_P)
    for start in range(0, n_parts, BLOCK_P):
        idx = start + offsets
        mask = idx < n_parts
        p_max = tl.load(pmax_ptr + row * n_parts + idx, mask=mask, other=float("-inf"))
        p_sum = tl.load(psum_ptr + row * n_parts + idx, mask=mask, other=0.0)
        new_max = tl.maximum(run_max, tl.max(p_max, axis=0))
        rescaled = tl.sum(p_sum * tl.exp(p_max - new_max), axis=0)
        run_sum = run_sum * tl.exp(run_max - new_max) + rescaled
        run_max = new_max
        if WITH_Z:
            z_total += tl.sum(tl.load(pz_ptr + row * n_parts + idx, mask=mask, other=0.0), axis=0)
    return run_max, run_max + tl.log(run_sum), z_total
