"""The Triton kernels compile for Hopper (sm_90) down to a cubin, on any machine.

The interpreter (used by the CPU tests) executes Python semantics and accepts code that the
real compiler rejects (loop-carried type changes, unsupported ops). Compiling ahead of time
with Triton's bundled ptxas catches that in CPU-only CI, before a GPU ever sees the kernel.
It runs in a fresh interpreter without TRITON_INTERPRET: Triton's own library functions are
jitted at import in whichever mode is set then, and interpreted ones cannot be compiled.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# (logits dtype, grad dtype, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING, HAS_LSE, HAS_PARTIALS, COMPUTE_GRAD,
#  HAS_CLASS_WEIGHT, WANT_ARGMAX, WANT_ENTROPY, HAS_TOKEN_SCALING, HAS_ENTROPY_GRAD)
_NO_RECORDS = (False,) * 5
VARIANTS = [
    ("*fp32", "*fp32", False, False, False, False, False, False, *_NO_RECORDS),
    ("*fp32", "*bf16", True, True, True, False, False, True, *_NO_RECORDS),
    ("*fp32", "*fp16", False, True, False, True, False, True, *_NO_RECORDS),
    ("*fp32", "*fp32", True, False, True, True, False, True, *_NO_RECORDS),
    ("*bf16", "*bf16", True, True, True, False, False, True, *_NO_RECORDS),
    ("*bf16", "*bf16", False, False, False, False, True, True, *_NO_RECORDS),
    ("*fp16", "*fp16", True, True, True, False, True, False, *_NO_RECORDS),
    # the row_io records: every one with a gradient; outputs without one; class weights and the
    # entropy's gradient in a column block; outputs after partials
    ("*fp32", "*bf16", True, True, True, False, False, True, True, True, True, True, True),
    ("*bf16", "*bf16", False, False, False, False, False, False, False, True, True, False, False),
    ("*bf16", "*bf16", True, True, True, True, False, True, True, False, False, False, True),
    ("*bf16", "*bf16", False, True, False, False, True, True, True, True, False, True, False),
]
# The logits GEMM with log-sum-exp partials: (operand dtype, HAS_BIAS, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING)
LOGITS_VARIANTS = [
    ("bf16", False, False, False, False),
    ("bf16", True, True, True, True),
    ("fp16", False, False, True, False),
]

COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from liger_patch.ops.core.triton.common import fold_partials, round_bf16_nearest, softcap as _softcap
from liger_patch.ops.cross_entropy.triton.rows import _ce_rows_kernel
from liger_patch.ops.core.tuning import Tuning

# The leading arguments in the kernel's order; all fp32 pointers unless set below.
leading = ["logits_ptr", "grad_ptr", "labels_ptr", "coef_ce_ptr", "coef_z_ptr", "lse_in_ptr",
           "pmax_ptr", "psum_ptr", "pz_ptr", "n_parts", "ce_ptr", "lse_ptr", "cw_ptr", "cw_total_ptr",
           "argmax_ptr", "entropy_ptr", "token_scale_ptr", "eg_coef_ptr", "eg_entropy_ptr"]
scalars = {"n_parts": "i32", "stride_logits": "i64", "stride_grad": "i64", "V": "i32",
           "col_offset": "i32", "V_total": "i32", "ignore_index": "i64",
           "logit_scale": "fp32", "softcap": "fp32", "smoothing": "fp32", "z_loss_scale": "fp32"}
flag_names = ["HAS_SCALE", "HAS_SOFTCAP", "HAS_SMOOTHING", "HAS_LSE", "HAS_PARTIALS", "COMPUTE_GRAD",
              "HAS_CLASS_WEIGHT", "WANT_ARGMAX", "WANT_ENTROPY", "HAS_TOKEN_SCALING", "HAS_ENTROPY_GRAD"]
kernel = triton.jit(_ce_rows_kernel)
softcap = triton.jit(_softcap)
fold_fn = triton.jit(fold_partials)
round_fn = triton.jit(round_bf16_nearest)
report = []
for logits_dtype, grad_dtype, *flags in json.loads(sys.argv[1]):
    signature = {name: "*fp32" for name in leading}
    signature.update(logits_ptr=logits_dtype, grad_ptr=grad_dtype, labels_ptr="*i64",
                     argmax_ptr="*i64", **scalars)
    wider = logits_dtype == "*fp32" and grad_dtype != "*fp32"
    constexprs = dict(zip(flag_names, flags), GRAD_ALIASES_WIDER=wider, REVERSE_PASS2=not wider,
                      BLOCK_V=8192, BLOCK_P=1024, SOFTCAP_FN=softcap, FOLD_FN=fold_fn)
    signature.update({name: "constexpr" for name in constexprs})
    names = list(signature)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    report.append({"cubin_bytes": len(compiled.asm["cubin"]),
                   "stores": compiled.asm["ptx"].count("st.global")})
from liger_patch.ops.core.triton.scale import _scale_kernel

scale = triton.jit(_scale_kernel)
for dtype in ("*fp32", "*bf16", "*fp16"):  # x in each dtype, y bf16 (grad_h beside a grad_W)
    src = ASTSource(fn=scale, signature={"x_ptr": dtype, "y_ptr": "*bf16", "scale_ptr": "*fp32",
                                         "n_x": "i64", "n_y": "i64", "BLOCK": "constexpr",
                                         "ROUND_X": "constexpr", "ROUND_Y": "constexpr",
                                         "ROUND_FN": "constexpr"},
                    constexprs={(5,): 4096, (6,): False, (7,): False, (8,): round_fn})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    report.append({"cubin_bytes": len(compiled.asm["cubin"]),
                   "stores": compiled.asm["ptx"].count("st.global")})
from liger_patch.ops.core.triton.label_check import _label_check_kernel

label_kernel = triton.jit(_label_check_kernel)
for divisor, items in ((1, "*fp32"), (2, "*i64")):  # the kept count; a num_items_in_batch tensor
    signature = {"labels_ptr": "*i64", "safe_ptr": "*i64", "weight_ptr": "*fp32", "stats_ptr": "*i64",
                 "scalars_ptr": "*fp32", "items_ptr": items, "n": "i32", "vocab": "i32",
                 "ignore_index": "i64", "fixed_divisor": "fp32", "DIVISOR": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn=label_kernel, signature=signature, constexprs={(10,): divisor, (11,): 4096})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    report.append({"cubin_bytes": len(compiled.asm["cubin"]),
                   "stores": compiled.asm["ptx"].count("st.global")})
from liger_patch.ops.core.triton.logits import _GROUP_M, _logits_lse_kernel

bm, bn, bk, stages, warps = Tuning().logits_tiles
logits_kernel = triton.jit(_logits_lse_kernel)
for dtype, *flags in json.loads(sys.argv[2]):
    signature = {"h_desc": f"tensordesc<{dtype}[{bm},{bk}]>", "w_desc": f"tensordesc<{dtype}[{bn},{bk}]>",
                 "out_desc": f"tensordesc<{dtype}[{bm},{bn}]>", "bias_ptr": f"*{dtype}",
                 "pmax_ptr": "*fp32", "psum_ptr": "*fp32", "pz_ptr": "*fp32",
                 "M": "i32", "V": "i32", "K": "i32", "logit_scale": "fp32", "softcap": "fp32"}
    constexprs = dict(zip(["HAS_BIAS", "HAS_SCALE", "HAS_SOFTCAP", "HAS_SMOOTHING"], flags),
                      ROUND_BF16_NEAREST=False, ROUND_FN=round_fn, BM=bm, BN=bn, BK=bk, GROUP_M=_GROUP_M,
                      PROGRAMS=132, SOFTCAP_FN=softcap)
    signature.update({name: "constexpr" for name in constexprs})
    names = list(signature)
    src = ASTSource(fn=logits_kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    report.append({"cubin_bytes": len(compiled.asm["cubin"]), "stores": ptx.count("st.global"),
                   "tma": ptx.count("cp.async.bulk.tensor"), "wgmma": ptx.count("wgmma.mma_async")})
print(json.dumps(report))
"""


def test_row_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(VARIANTS), json.dumps(LOGITS_VARIANTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # the row kernel's variants, the scale kernel's dtypes, the label check's divisors, the logits
    # GEMM's variants
    scales = ["scale fp32", "scale bf16", "scale fp16"]
    names = VARIANTS + scales + ["labels count", "labels items"] + LOGITS_VARIANTS
    assert len(report) == len(names)
    for variant, built in zip(names, report, strict=True):
        assert built["cubin_bytes"] > 0, f"no cubin for {variant}"
        assert built["stores"] > 0, f"no global stores in the PTX for {variant}"
    for variant, built in zip(LOGITS_VARIANTS, report[-len(LOGITS_VARIANTS) :], strict=True):
        # The point of this kernel: TMA loads/stores and Hopper's asynchronous tensor-core MMA.
        assert built["tma"] > 0, f"no TMA copies in the logits GEMM for {variant}"
        assert built["wgmma"] > 0, f"no wgmma in the logits GEMM for {variant}"
