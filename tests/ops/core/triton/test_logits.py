"""The Triton logits GEMM that leaves log-sum-exp partials (``ops/core/triton/logits.py``).

Its logits and partials are checked against fp64; the op through it against the fp64 reference
in every option, with a spy proving the path ran; and the cases it must leave to cuBLAS. Under
the interpreter (CPU) the GEMM runs in fp32, as every CPU GEMM here does; on a Hopper GPU in the
input's half dtype.
"""

import dataclasses
import math

import pytest
import torch
from op_helpers import DTYPES, IGNORE_PATTERNS, TOL, call_rows, check_parity, make_case, record_calls

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import chunks as chunked
from liger_patch.ops.cross_entropy.options import LossOptions

triton_logits = pytest.importorskip("liger_patch.ops.core.triton.logits")


def _fused_runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Where the op sends aligned chunks of this input dtype through the fused GEMM (default
    logits dtype): always under the interpreter; on CUDA for half inputs on Hopper or later."""
    if device.type == "cpu":
        return True
    return dtype != torch.float32 and torch.cuda.get_device_capability(device) >= (9, 0)


@pytest.fixture
def fused_calls(monkeypatch):
    """Row counts of the chunks that went through the fused GEMM (those that came with partials):
    a first chunk begun before the label check (``head_start``) counts once, when it is used."""
    calls = []
    real = chunked._chunk_logits

    def spy(*args, **kwargs):
        made = real(*args, **kwargs)
        if made.partials is not None:
            calls.append(made.logits.shape[0])
        return made

    monkeypatch.setattr(chunked, "_chunk_logits", spy)
    return calls


def _assert_fused_covered(calls: list[int], n_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
    """Every token went through the fused GEMM where it runs, none elsewhere. (How many rows
    each chunk holds differs: the CPU keeps the forced 16, CUDA's grad_W accumulator may cut it.)"""
    if _fused_runs_on(device, dtype):
        assert sum(calls) == n_tokens and all(rows > 0 for rows in calls), calls
    else:
        assert calls == []


def _rows_walked(case, tuning: Tuning) -> int:
    """Rows the forward's token chunks walk: the kept ones when it skips the ignored ones."""
    n, kept = case.labels.numel(), case.n_kept
    return kept if tuning.skips_ignored(n, kept) else n


def _transform(x: torch.Tensor, opts: LossOptions) -> torch.Tensor:
    z = x * opts.scale
    return opts.softcap * torch.tanh(z / opts.softcap) if opts.softcap is not None else z


OPTIONS = [LossOptions(), LossOptions(label_smoothing=0.1, softcap=4.0, logit_scale=0.6)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("opts", OPTIONS, ids=["plain", "options"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_logits_and_partials_match_fp64(gen, device, out_dtype, opts, bias):
    # 37 rows, V = 200 and H = 40 leave part-filled tiles in all three GEMM dimensions.
    rows, hdim, vocab = 37, 40, 200
    operand = torch.float32 if device.type == "cpu" else out_dtype
    h = torch.randn(rows, hdim, generator=gen).to(operand).to(device)
    w = (torch.randn(vocab, hdim, generator=gen) * 3 / math.sqrt(hdim)).to(operand).to(device)
    b = (torch.randn(vocab, generator=gen) * 0.5).to(device) if bias else None
    if device.type == "cuda" and (out_dtype == torch.float32 or torch.cuda.get_device_capability() < (9, 0)):
        # fp32 would run as TF32 and its output tile does not fit next to the operand stages.
        assert not triton_logits.supported(h, w, out_dtype, Tuning())
        return
    assert triton_logits.supported(h, w, out_dtype, Tuning())
    out = torch.full((rows, vocab), float("nan"), dtype=out_dtype, device=device)
    pmax, psum, pz = triton_logits.logits_with_partials(h, w, b, opts, out)

    ref = h.double() @ w.double().t() + (0 if b is None else b.double())
    # Stored once, rounded to nearest in out_dtype: at most one ulp from the rounded fp64 value.
    torch.testing.assert_close(
        out.double(), ref.to(out_dtype).double(), rtol=torch.finfo(out_dtype).eps, atol=1e-5
    )
    # The partials describe exactly the stored values, after scale and softcap.
    z = _transform(out.double(), opts)
    lse = torch.logsumexp(pmax.double() + psum.double().log(), dim=1)
    torch.testing.assert_close(lse.cpu(), torch.logsumexp(z, dim=1).cpu(), rtol=1e-5, atol=1e-5)
    assert pmax.shape == psum.shape and pmax.shape[0] == rows
    assert (psum >= 1).all(), "each tile's sum of exp(z - its max) includes exp(0)"
    if opts.label_smoothing:
        torch.testing.assert_close(pz.double().sum(1).cpu(), z.sum(1).cpu(), rtol=1e-5, atol=1e-4)
    else:
        assert pz is None


@pytest.mark.parametrize(
    "opts",
    [
        dict(reduction="mean"),
        dict(reduction="sum", label_smoothing=0.1),
        dict(reduction="none", softcap=5.0, logit_scale=0.7),
        dict(reduction="mean", z_loss_scale=1e-2, return_z_loss=True),
        dict(reduction="mean", num_items_in_batch=17, label_smoothing=0.05, softcap=8.0),
    ],
    ids=str,
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_op_parity_through_the_fused_gemm(gen, device, chunk_rows, fused_calls, dtype, bias, opts):
    # 48 tokens in chunks of 16; V = 136 is 4 tiles of 32 and 8 columns (interpreter tiles).
    tuned = chunk_rows(16, 136)
    case = make_case(gen, (3, 16), 24, 136, dtype=dtype, device=device, bias=bias)
    check_parity(case, gen, tol=TOL[dtype], backend="triton", **opts, **tuned)
    _assert_fused_covered(fused_calls, _rows_walked(case, tuned["tuning"]), device, dtype)


@pytest.mark.parametrize("skip_share", [0.0, 1.0], ids=["skip_ignored", "every_row"])
@pytest.mark.parametrize("pattern", IGNORE_PATTERNS + ["all"])
def test_ignored_tokens_in_every_position(gen, device, chunk_rows, fused_calls, pattern, skip_share):
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tuned = chunk_rows(16, 64)
    tuned["tuning"] = dataclasses.replace(tuned["tuning"], skip_ignored_share=skip_share)
    case = make_case(gen, (40,), 16, 64, dtype=dtype, device=device, ignore=pattern)
    check_parity(case, gen, tol=TOL[dtype], backend="triton", z_loss_scale=1e-3, return_z_loss=True, **tuned)
    _assert_fused_covered(fused_calls, _rows_walked(case, tuned["tuning"]), device, dtype)


def test_two_pass_path_uses_it_for_pass_a(gen, device, chunk_rows, fused_calls, monkeypatch):
    """Pass A (loss, grad_h) takes the fused GEMM; pass B, with the log-sum-exp known, does not."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    vocab_passes = record_calls(monkeypatch, chunked, "vocab_pass")
    tuned = chunk_rows(16, 64, two_pass=True)
    case = make_case(gen, (40,), 16, 64, dtype=dtype, device=device, bias=True)
    check_parity(case, gen, tol=TOL[dtype], backend="triton", label_smoothing=0.1, **tuned)
    assert vocab_passes
    _assert_fused_covered(fused_calls, 40, device, dtype)


def test_backward_recompute_leaves_it_to_cublas(gen, device, fused_calls):
    """fp16 and reduction="none" recompute the logits in the backward with the saved
    log-sum-exp: partials would save nothing there, so only the forward's chunk uses the GEMM."""
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    case = make_case(gen, (24,), 16, 64, device=device, dtype=dtype)
    check_parity(case, gen, tol=TOL[case.hidden.dtype], backend="triton", reduction="none")
    assert len(fused_calls) == (1 if _fused_runs_on(device, case.hidden.dtype) else 0)


def test_misaligned_vocabulary_falls_back(gen, device, fused_calls):
    """Logits rows of V = 130 half values are not 16-byte aligned for TMA: cuBLAS computes them."""
    dtype = torch.bfloat16
    case = make_case(gen, (24,), 16, 130, dtype=dtype, device=device)
    check_parity(case, gen, tol=TOL[dtype], backend="triton")
    assert fused_calls == []


def test_switched_off(gen, device, fused_calls):
    case = make_case(gen, (24,), 16, 64, device=device)
    check_parity(case, gen, tol=TOL[torch.float32], backend="triton", tuning=Tuning(fused_logits=False))
    assert fused_calls == []


def test_row_kernel_refuses_partials_it_cannot_use(device):
    from liger_patch.ops.cross_entropy.triton.rows import ce_rows_triton

    logits = torch.randn(4, 64, device=device)
    labels = torch.zeros(4, dtype=torch.long, device=device)
    parts = (torch.zeros(4, 2, device=device), torch.ones(4, 2, device=device), None)
    with pytest.raises(ValueError, match="partials"):
        call_rows(
            ce_rows_triton,
            logits,
            labels,
            LossOptions(),
            lse_in=torch.zeros(4, device=device),
            partials=parts,
        )
    with pytest.raises(ValueError, match="partials"):
        call_rows(ce_rows_triton, logits, labels, LossOptions(), partials=(parts[0][:3], parts[1][:3], None))
