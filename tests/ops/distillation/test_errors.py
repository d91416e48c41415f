"""Bad input to ``fused_linear_distillation`` and its Module: a clear error naming the problem
(ValueError, TypeError, IndexError), and the process stays usable."""

from __future__ import annotations

import math

import pytest
import torch

import liger_patch as lp

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

N, HS, HT, V = 6, 5, 7, 11


def _inputs(gen, dtype=torch.float32, device="cpu"):
    """A small valid call's tensors on ``device`` (drawn on the CPU), the student's requiring grad."""
    return dict(
        student_hidden=torch.randn(2, N, HS, generator=gen).to(device, dtype).requires_grad_(),
        student_weight=torch.randn(V, HS, generator=gen).to(device, dtype).requires_grad_(),
        teacher_hidden=torch.randn(2, N, HT, generator=gen).to(device, dtype),
        teacher_weight=torch.randn(V, HT, generator=gen).to(device, dtype),
        labels=torch.randint(0, V, (2, N), generator=gen).to(device),
    )


def _call(inputs, **options):
    return lp.fused_linear_distillation(**inputs, **options)


@pytest.mark.parametrize(
    ("option", "value", "error", "match"),
    [
        ("beta", -0.1, ValueError, r"beta must be in \[0, 1\], got -0.1"),
        ("beta", 1.5, ValueError, r"beta must be in \[0, 1\]"),
        ("beta", math.nan, ValueError, r"beta must be in \[0, 1\]"),
        ("beta", "0.5", TypeError, "beta must be a number"),
        ("temperature", 0.0, ValueError, "temperature must be a finite number > 0"),
        ("temperature", -1.0, ValueError, "temperature must be a finite number > 0"),
        ("temperature", math.inf, ValueError, "temperature must be a finite number > 0"),
        ("ce_weight", 1.01, ValueError, r"ce_weight must be in \[0, 1\]"),
        ("ce_weight", -1, ValueError, r"ce_weight must be in \[0, 1\]"),
        ("student_softcap", 0.0, ValueError, "student_softcap must be a finite number > 0"),
        ("teacher_softcap", -2.0, ValueError, "teacher_softcap must be a finite number > 0"),
        ("student_logit_scale", 0.0, ValueError, "student_logit_scale must be a finite non-zero"),
        ("teacher_logit_scale", math.inf, ValueError, "teacher_logit_scale must be a finite non-zero"),
        ("reduction", "batchmean", ValueError, "unknown reduction 'batchmean'"),
        ("backend", "cuda", ValueError, "unknown backend 'cuda'"),
        ("memory_budget", "lots", ValueError, "memory_budget 'lots'"),
        ("ignore_index", 1.5, TypeError, "ignore_index must be an int"),
        ("logits_dtype", "float32", ValueError, "logits_dtype must be None or a float dtype"),
        ("logits_dtype", torch.float64, ValueError, "logits_dtype must be None or a float dtype"),
        ("logits_dtype", torch.int32, ValueError, "logits_dtype must be None or a float dtype"),
        ("logits_dtype", 4, ValueError, "logits_dtype must be None or a float dtype"),
    ],
)
def test_bad_option(gen, option, value, error, match):
    inputs = _inputs(gen)
    with pytest.raises(error, match=match):
        _call(inputs, **{option: value})
    with pytest.raises(error, match=match):
        lp.FusedLinearDistillationLoss(**{option: value})
    assert torch.isfinite(_call(inputs))  # still usable


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_logits_dtype_must_suit_each_side(gen, device, backend):
    """A half ``logits_dtype`` other than a side's input dtype is refused at the call, naming the
    side (as the cross-entropy op refuses it); fp32 suits every input, the input's own dtype its side."""
    half = _inputs(gen, torch.bfloat16, device)
    with pytest.raises(
        ValueError, match=r"student: logits_dtype must be None \(the input dtype, torch.bfloat16\)"
    ):
        _call(half, logits_dtype=torch.float16, backend=backend)
    with pytest.raises(ValueError, match="student: logits_dtype must be None"):
        _call(_inputs(gen, device=device), logits_dtype=torch.bfloat16, backend=backend)
    mixed = half | {k: v.float() for k, v in half.items() if k.startswith("teacher")}
    with pytest.raises(
        ValueError, match=r"teacher: logits_dtype must be None \(the input dtype, torch.float32\)"
    ):
        lp.FusedLinearDistillationLoss(logits_dtype=torch.bfloat16, backend=backend)(**mixed)
    for logits_dtype in (None, torch.float32):
        assert torch.isfinite(_call(mixed, logits_dtype=logits_dtype, backend=backend))
    assert torch.isfinite(_call(half, logits_dtype=torch.bfloat16, backend=backend))


def test_triton_backend_needs_cuda_or_the_interpreter(gen, device, monkeypatch):
    """Backend "triton" on CPU tensors without ``TRITON_INTERPRET=1`` says what it needs (read on every
    call), and "auto" then runs the PyTorch backend. Where Triton can run (CUDA tensors on a GPU, CPU
    ones under the interpreter that tests/conftest.py turns on without one), "auto" runs it, and it
    agrees with the PyTorch backend."""
    pytest.importorskip("triton")
    inputs = _inputs(gen)
    with monkeypatch.context() as env:
        env.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1"):
            _call(inputs, backend="triton")
        on_torch = _call(inputs, beta=0.5)
        assert torch.equal(on_torch, _call(inputs, beta=0.5, backend="torch"))
    runnable = {k: v.detach().to(device).requires_grad_(v.requires_grad) for k, v in inputs.items()}
    on_triton = _call(runnable, beta=0.5, backend="triton")
    assert torch.equal(_call(runnable, beta=0.5), on_triton)
    torch.testing.assert_close(on_triton.cpu(), on_torch)


def test_unknown_option(gen):
    with pytest.raises(TypeError, match="alpha"):
        _call(_inputs(gen), alpha=0.5)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['alpha'\]; the options are \[.*'beta'"):
        lp.FusedLinearDistillationLoss(alpha=0.5)


def test_num_items_in_batch(gen):
    inputs = _inputs(gen)
    with pytest.raises(ValueError, match="num_items_in_batch .* reduction='sum'"):
        _call(inputs, reduction="sum", num_items_in_batch=4)
    with pytest.raises(ValueError, match="num_items_in_batch must be finite and >= 0"):
        _call(inputs, num_items_in_batch=-1)
    with pytest.raises(ValueError, match="num_items_in_batch must be finite and >= 0"):
        _call(inputs, num_items_in_batch=torch.tensor(-3.0))


@pytest.mark.parametrize("bad", [V, -1, -101, 10**6])
def test_label_out_of_range(gen, bad):
    inputs = _inputs(gen)
    inputs["labels"][1, 3] = bad
    with pytest.raises(IndexError, match=rf"label {bad} at flat position {N + 3} is outside \[0, {V}\)"):
        _call(inputs)


def test_label_equal_to_custom_ignore_index_is_fine(gen):
    inputs = _inputs(gen)
    inputs["labels"][0, 0] = -1
    assert torch.isfinite(_call(inputs, ignore_index=-1))


def test_vocabulary_mismatch_names_both_sizes(gen):
    inputs = _inputs(gen)
    inputs["teacher_weight"] = torch.randn(V + 2, HT, generator=gen)
    with pytest.raises(ValueError, match=rf"student_weight has V={V} .* teacher_weight has V={V + 2}"):
        _call(inputs)


@pytest.mark.parametrize(
    ("name", "shape", "match"),
    [
        ("student_weight", (V, HS + 1), "student: hidden size mismatch: hidden has H=5"),
        ("teacher_weight", (V, HT - 1), "teacher: hidden size mismatch: hidden has H=7"),
        ("teacher_hidden", (2, N + 1, HT), r"teacher: labels shape \(2, 6\) does not match"),
        ("student_hidden", (N, 2, HS), r"student: labels shape \(2, 6\) does not match"),
        ("labels", (2 * N,), r"student: labels shape \(12,\) does not match"),
        ("student_weight", (V * HS,), r"student: weight must have shape \(V, H\)"),
        ("student_bias", (V + 1,), r"student: bias must have shape \(V,\) = \(11,\)"),
        ("teacher_bias", (1, V), r"teacher: bias must have shape \(V,\)"),
    ],
)
def test_shape_mismatch(gen, name, shape, match):
    inputs = _inputs(gen)
    dtype = torch.int64 if name == "labels" else torch.float32
    inputs[name] = torch.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        _call(inputs)


@pytest.mark.parametrize(
    ("name", "dtype", "match"),
    [
        ("labels", torch.float32, "student: labels must be an integer tensor"),
        ("labels", torch.bool, "student: labels must be an integer tensor"),
        ("student_hidden", torch.float64, "student: hidden must be float32, bfloat16 or float16"),
        ("teacher_weight", torch.int32, "teacher: weight must be float32, bfloat16 or float16"),
        ("student_weight", torch.bfloat16, "student: dtype mismatch: hidden is torch.float32, weight is"),
        ("teacher_hidden", torch.float16, "teacher: dtype mismatch: hidden is torch.float16"),
    ],
)
def test_wrong_dtype(gen, name, dtype, match):
    inputs = _inputs(gen)
    inputs[name] = inputs[name].detach().to(dtype)
    with pytest.raises(TypeError, match=match):
        _call(inputs)


def test_not_a_tensor(gen):
    inputs = _inputs(gen)
    inputs["teacher_hidden"] = inputs["teacher_hidden"].tolist()
    with pytest.raises(TypeError, match="teacher: hidden must be a torch.Tensor, got list"):
        _call(inputs)


def test_student_and_teacher_may_differ_in_dtype(gen):
    """Each side is checked on its own: a bf16 teacher beside an fp32 student is fine."""
    inputs = _inputs(gen)
    inputs["teacher_hidden"] = inputs["teacher_hidden"].bfloat16()
    inputs["teacher_weight"] = inputs["teacher_weight"].bfloat16()
    assert torch.isfinite(_call(inputs, beta=0.5))
