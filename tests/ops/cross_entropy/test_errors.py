"""Bad input (issue #2, section 4): ValueError, TypeError or IndexError with a message that
names the problem. Never garbage, never a hang, and the process stays usable afterwards."""

import pytest
import torch
from op_helpers import BACKENDS, TOL, assert_close, call_raw, make_case, raises_by_step, reference_for

H, V = 19, 97
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(gen, device, lead=(2, 5), dtype=torch.float32):
    case = make_case(gen, lead, H, V, dtype=dtype, device=device, bias=True, ignore="first")
    return case.hidden, case.weight, case.labels, case.bias


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize("labels_shape", [(2, 4), (10,), (2, 5, 1), (5, 2), ()], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_labels_shape_mismatch(gen, device, backend, labels_shape):
    h, w, _, _ = _inputs(gen, device)
    y = torch.randint(0, V, labels_shape, generator=gen).to(device)
    with pytest.raises(ValueError, match=r"(?i)label"):
        call_raw(h, w, y, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_weight_size_mismatch(gen, device, backend):
    h, _, y, _ = _inputs(gen, device)
    w = torch.randn(V, H + 1, generator=gen).to(device)
    with pytest.raises(ValueError, match=r"(?i)hidden|weight"):
        call_raw(h, w, y, backend=backend)


@pytest.mark.parametrize("shape", [(V * H,), (1, V, H)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_not_2d(gen, device, backend, shape):
    h, _, y, _ = _inputs(gen, device)
    w = torch.randn(shape, generator=gen).to(device)
    with pytest.raises(ValueError, match=r"(?i)weight"):
        call_raw(h, w, y, backend=backend)


@pytest.mark.parametrize("shape", [(V + 1,), (V - 1,), (1, V), (H,)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_bias_shape(gen, device, backend, shape):
    h, w, y, _ = _inputs(gen, device)
    b = torch.randn(shape, generator=gen).to(device)
    with pytest.raises(ValueError, match=r"(?i)bias"):
        call_raw(h, w, y, b, backend=backend)


# ---------------------------------------------------------------- labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bool], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_integer_labels(gen, device, backend, dtype):
    h, w, y, _ = _inputs(gen, device)
    y = (y.clamp(min=0) % 2).to(dtype) if dtype == torch.bool else y.to(dtype)
    with pytest.raises(TypeError, match=r"(?i)label"):
        call_raw(h, w, y, backend=backend)


@pytest.mark.parametrize(
    "bad,position,ignore_index",
    [
        (V, "first", -100),
        (V, "last", -100),
        (10**9, "middle", -100),
        (-5, "last", -100),
        (-100, "middle", -1),
    ],
    ids=["V-first", "V-last", "huge-middle", "negative-last", "default_ignore_with_ignore_index_-1"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_label_out_of_range(gen, device, chunk_rows, backend, bad, position, ignore_index):
    tuned = chunk_rows(3, V)  # the bad label may sit in the remainder chunk
    h, w, y, b = _inputs(gen, device, lead=(37,))
    y = y.clamp(min=0)
    y[{"first": 0, "last": -1, "middle": 17}[position]] = bad
    with raises_by_step(IndexError, match=r"(?i)range|out of|outside"):
        call_raw(h, w, y, b, backend=backend, ignore_index=ignore_index, **tuned)


@pytest.mark.parametrize("backend", BACKENDS)
def test_label_out_of_range_without_grad(gen, device, backend):
    h, w, y, b = _inputs(gen, device)
    y[0, 1] = V + 3
    with torch.no_grad(), raises_by_step(IndexError, match=r"(?i)range|out of|outside"):
        call_raw(h, w, y, b, backend=backend, reduction="none")


@pytest.mark.parametrize("backend", BACKENDS)
def test_usable_after_an_index_error(gen, device, backend):
    """A rejected label must not poison the process (e.g. a CUDA device-side assert)."""
    h, w, y, b = _inputs(gen, device)
    bad = y.clone()
    bad[1, 2] = V
    with raises_by_step(IndexError):
        call_raw(h, w, bad, b, backend=backend)
    case = make_case(gen, (2, 5), H, V, device=device, bias=True, requires_grad=())
    loss = call_raw(case.hidden, case.weight, case.labels, case.bias, backend=backend)
    ref, _, _ = reference_for(case)
    assert_close("loss after error", loss, ref, TOL[torch.float32])


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("reduction", ["avg", "batchmean", ""])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_reduction(gen, device, backend, reduction):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(ValueError, match=r"(?i)reduction"):
        call_raw(h, w, y, backend=backend, reduction=reduction)


@pytest.mark.parametrize("softcap", [0.0, -1.0, -30.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_not_positive(gen, device, backend, softcap):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(ValueError, match=r"(?i)softcap"):
        call_raw(h, w, y, backend=backend, softcap=softcap)


@pytest.mark.parametrize("eps", [-0.1, 1.5])
@pytest.mark.parametrize("backend", BACKENDS)
def test_label_smoothing_out_of_range(gen, device, backend, eps):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(ValueError, match=r"(?i)smoothing"):
        call_raw(h, w, y, backend=backend, label_smoothing=eps)


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_num_items_in_batch_needs_mean(gen, device, backend, reduction):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(ValueError, match=r"(?i)num_items"):
        call_raw(h, w, y, backend=backend, reduction=reduction, num_items_in_batch=8)


@pytest.mark.parametrize("backend", ["foo", "cuda", ""])
def test_unknown_backend(gen, device, backend):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(ValueError, match=r"(?i)backend"):
        call_raw(h, w, y, backend=backend)


# ---------------------------------------------------------------- dtypes and devices


@pytest.mark.parametrize(
    "hdt,wdt",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.float16), (torch.float16, torch.bfloat16)],
    ids=["bf16-fp32", "fp32-fp16", "fp16-bf16"],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_hidden_weight_dtypes_outside_autocast(gen, device, backend, hdt, wdt):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(TypeError, match=r"(?i)dtype"):
        call_raw(h.to(hdt), w.to(wdt), y, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_dtype_mismatch(gen, device, backend):
    h, w, y, b = _inputs(gen, device)
    with pytest.raises(TypeError, match=r"(?i)dtype|bias"):
        call_raw(h, w, y, b.to(torch.float16), backend=backend)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_integer_hidden(gen, device, backend, dtype):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(TypeError, match=r"(?i)dtype|float"):
        call_raw((h * 10).to(dtype), w, y, backend=backend)


@CUDA
@pytest.mark.parametrize("which", ["weight", "labels", "bias"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_tensors_on_different_devices(gen, backend, which):
    h, w, y, b = _inputs(gen, torch.device("cuda"))
    args = dict(weight=w, labels=y, bias=b)
    args[which] = args[which].cpu()
    with pytest.raises(ValueError, match=r"(?i)device"):
        call_raw(h, args["weight"], args["labels"], args["bias"], backend=backend)


# ---------------------------------------------------------------- values checked on the device


BAD_DIVISORS = [(torch.int64, -6), (torch.int32, -1)] + [
    (torch.float32, v) for v in (-6.0, -0.5, float("inf"), float("-inf"), float("nan"))
]


@pytest.mark.parametrize(("dtype", "value"), BAD_DIVISORS, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_num_items_in_batch_tensor_out_of_range(gen, device, backend, dtype, value):
    """A tensor divisor is checked like an int or a float (it gave a loss of -4.75 for -6, 0 with
    zero gradients for inf, NaN for nan), inside the op's one host sync."""
    h, w, y, b = _inputs(gen, device)
    n = torch.tensor(value, dtype=dtype, device=device)
    with raises_by_step(ValueError, match="num_items_in_batch must be finite and >= 0"):
        call_raw(h, w, y, b, backend=backend, num_items_in_batch=n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_meta_tensors(backend):
    h, w = torch.randn(3, 4, device="meta"), torch.randn(5, 4, device="meta")
    y = torch.zeros(3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="meta device"):
        call_raw(h, w, y, backend=backend)


@pytest.mark.parametrize("ignore_index", [2**63, 2**70, -(2**63) - 1])
def test_ignore_index_beyond_int64(gen, device, ignore_index):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(ValueError, match="ignore_index must fit in int64"):
        call_raw(h, w, y, ignore_index=ignore_index)


@pytest.mark.parametrize("name", ["label_smoothing", "z_loss_scale", "softcap", "logit_scale"])
@pytest.mark.parametrize(
    "value", ["abc", "0.1", [0.1], object()], ids=["text", "numeric_text", "list", "object"]
)
def test_non_number_options_name_the_option(gen, device, name, value):
    h, w, y, _ = _inputs(gen, device)
    with pytest.raises(TypeError, match=f"{name} must be a number"):
        call_raw(h, w, y, **{name: value})
