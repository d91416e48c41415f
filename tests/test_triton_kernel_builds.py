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

# (logits dtype, grad dtype, HAS_SCALE, HAS_SOFTCAP, HAS_SMOOTHING, HAS_LSE, COMPUTE_GRAD)
VARIANTS = [
    ("*fp32", "*fp32", False, False, False, False, False),
    ("*fp32", "*bf16", True, True, True, False, True),
    ("*fp32", "*fp16", False, True, False, True, True),
    ("*fp32", "*fp32", True, False, True, True, True),
    ("*bf16", "*bf16", True, True, True, False, True),
]

COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from liger_patch.ops.triton_ce import _ce_rows_kernel

pointers = ["logits_ptr", "grad_ptr", "labels_ptr", "coef_ce_ptr", "coef_z_ptr", "lse_in_ptr",
            "ce_ptr", "lse_ptr"]
scalars = {"stride_logits": "i64", "stride_grad": "i64", "V": "i32", "col_offset": "i32",
           "V_total": "i32", "ignore_index": "i64",
           "logit_scale": "fp32", "softcap": "fp32", "smoothing": "fp32", "z_loss_scale": "fp32"}
flag_names = ["HAS_SCALE", "HAS_SOFTCAP", "HAS_SMOOTHING", "HAS_LSE", "COMPUTE_GRAD"]
kernel = triton.jit(_ce_rows_kernel)
report = []
for logits_dtype, grad_dtype, *flags in json.loads(sys.argv[1]):
    signature = {name: "*fp32" for name in pointers}
    signature.update(logits_ptr=logits_dtype, grad_ptr=grad_dtype, labels_ptr="*i64", **scalars)
    wider = logits_dtype == "*fp32" and grad_dtype != "*fp32"
    constexprs = dict(zip(flag_names, flags), GRAD_ALIASES_WIDER=wider, REVERSE_PASS2=not wider,
                      BLOCK_V=8192)
    signature.update({name: "constexpr" for name in constexprs})
    names = list(signature)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
    report.append({"cubin_bytes": len(compiled.asm["cubin"]),
                   "stores": compiled.asm["ptx"].count("st.global")})
from liger_patch.ops.triton_scale import _scale_kernel

scale = triton.jit(_scale_kernel)
for dtype in ("*fp32", "*bf16", "*fp16"):
    src = ASTSource(fn=scale, signature={"x_ptr": dtype, "scale_ptr": "*fp32", "n": "i64",
                                         "BLOCK": "constexpr"}, constexprs={(3,): 4096})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    report.append({"cubin_bytes": len(compiled.asm["cubin"]),
                   "stores": compiled.asm["ptx"].count("st.global")})
print(json.dumps(report))
"""


def test_row_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(VARIANTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == len(VARIANTS) + 3  # the row kernel's variants, the scale kernel's dtypes
    for variant, built in zip(VARIANTS + ["scale fp32", "scale bf16", "scale fp16"], report, strict=True):
        assert built["cubin_bytes"] > 0, f"no cubin for {variant}"
        assert built["stores"] > 0, f"no global stores in the PTX for {variant}"
