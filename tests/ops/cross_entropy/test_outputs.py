"""The fused op's optional outputs and loss variants against the fp64 reference
(liger_patch/ops/reference.py): z_loss, token_accuracy, predicted_tokens and entropy (alone and
together, every reduction), class weights (F.cross_entropy's ``weight=``, also checked against
F.cross_entropy itself) and token scaling (TRL's loss_type="dft", checked against TRL's formula
on dense fp64 logits). Values and the gradients of hidden, weight and bias, on both backends,
fp32 and bf16, odd shapes (V=97, H=19, N=26), several token chunks, the two-pass path, ignored
tokens in every position, all-ignored and empty batches, exact argmax ties, the named tuple,
non-contiguous inputs and bad class weights.

Argmax under rounding: the op's logits differ from the fp64 ones by about the input dtype's
rounding, so a predicted token may differ from the reference's only where the two largest
logits are within ``GAP_EPS[dtype] * max(1, max|z|)`` of each other (a near-tie): the op's
prediction must always be a near-maximum of the reference logits, and equal the reference's
argmax wherever the top-2 gap is wider. Exact ties are built from small dyadic values (exact in
bf16 and in any summation order) and must give the first index.

Every backward uses random upstream gradients on every differentiable output returned (a random
scalar for reduced outputs, a random tensor for reduction "none").
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from op_helpers import (
    BACKENDS,
    IGNORE_PATTERNS,
    OUTPUT_FLAGS,
    TOL,
    Case,
    assert_close,
    call_op,
    examples,
    make_case,
    near_max,
    record_calls,
    reference_outputs_for,
    top2_gap,
    upstream_like,
)

import liger_patch as lp
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import chunks as chunked
from liger_patch.ops.reference import reference_flce, reference_outputs, reference_token_outputs

FP32, BF16 = torch.float32, torch.bfloat16
ALL_OUTPUTS = tuple(OUTPUT_FLAGS)  # z_loss, token_accuracy, predicted_tokens, entropy
DIFFERENTIABLE = ("loss", "z_loss", "entropy")
REDUCTIONS = ("mean", "sum", "none")
# Relative size of a top-2 logit gap the op's rounding may flip (see the module doc).
GAP_EPS = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
H, V, N = 19, 97, 26


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def flags(outputs) -> dict:
    return {OUTPUT_FLAGS[name]: True for name in outputs}


def class_weights(gen, vocab, device, zero=()) -> torch.Tensor:
    w = torch.rand(vocab, generator=gen) * 1.5 + 0.25
    w[list(zero)] = 0.0
    return w.to(device)


# ---------------------------------------------------------------- the checker


def check_outputs(
    case: Case,
    gen: torch.Generator,
    *,
    tol: float,
    dtype: torch.dtype = FP32,
    outputs=ALL_OUTPUTS,
    upstream=DIFFERENTIABLE,
    strict_ties: bool = True,
    **opts,
) -> dict:
    """Call the op asking for ``outputs``, compare every output with the reference, backprop with
    random upstream gradients on the differentiable outputs named in ``upstream`` (those returned)
    and compare the gradients. ``strict_ties``: also require that most kept tokens have a clear
    top-2 gap (so the argmax comparison is not vacuous). Returns the op's outputs by name."""
    out = call_op(case, **flags(outputs), **opts)
    expected_fields = ("loss", *(n for n in ALL_OUTPUTS if n in outputs))
    if not outputs:
        assert isinstance(out, torch.Tensor) and not isinstance(out, tuple), type(out)
        got = {"loss": out}
    else:
        assert isinstance(out, tuple) and type(out).__name__ == "FusedLossOutput", type(out)
        assert out._fields == expected_fields, out._fields
        assert len(out) == len(expected_fields)
        got = out._asdict()
    ref = reference_outputs_for(case, **opts)
    reduction = opts.get("reduction", "mean")
    lead = tuple(case.labels.shape)
    value_shape = lead if reduction == "none" else ()

    labels = case.labels.reshape(-1).cpu()
    keep = labels != case.ignore_index
    logits = ref["logits"]
    # A per-token loss or entropy is a difference of terms as large as the logits: its rounding
    # error scales with them, not with the (possibly tiny) result. A tenth of tol per token.
    n_summed = int(keep.sum()) if reduction == "sum" else 1
    z_max = float(logits[keep].abs().max()) if bool(keep.any()) else 0.0
    floor = tol / 10 * z_max * n_summed
    for name in ("loss", "z_loss", "entropy"):
        if name in got:
            assert got[name].dtype == torch.float32, f"{name} dtype {got[name].dtype}"
            assert tuple(got[name].shape) == value_shape, f"{name} shape {tuple(got[name].shape)}"
            assert_close(name, got[name], ref[name], tol, floor=0.0 if name == "z_loss" else floor)

    gap_tol = GAP_EPS[dtype] * logits.abs().amax(dim=-1).clamp_min(1.0)
    clear = top2_gap(logits) > gap_tol
    if strict_ties and int(keep.sum()) >= 4:
        assert int((clear & keep).sum()) * 2 >= int(keep.sum()), "test too weak: most tokens are near-ties"

    pred = None
    if "predicted_tokens" in got:
        p = got["predicted_tokens"]
        assert p.dtype == torch.int64 and tuple(p.shape) == lead, (p.dtype, tuple(p.shape))
        assert not p.requires_grad
        pred = p.reshape(-1).cpu()
        assert (pred[~keep] == -1).all(), f"predicted tokens at ignored positions: {pred[~keep]}"
        kp = pred[keep]
        assert ((kp >= 0) & (kp < case.weight.shape[0])).all(), f"predicted out of range: {kp}"
        ok = near_max(logits[keep], kp, gap_tol[keep])
        assert ok.all(), (
            f"predicted tokens {kp[~ok].tolist()} are not near-maxima; reference argmax "
            f"{ref['predicted_tokens'].reshape(-1)[keep][~ok].tolist()}"
        )
        ref_pred = ref["predicted_tokens"].reshape(-1)
        assert torch.equal(pred[clear], ref_pred[clear]), "predicted token differs where there is no near-tie"

    if "token_accuracy" in got:
        acc = got["token_accuracy"]
        assert acc.dtype == torch.float32 and tuple(acc.shape) == value_shape, (acc.dtype, tuple(acc.shape))
        assert not acc.requires_grad, "token accuracy must not require grad"
        ref_correct = ref["correct"].reshape(-1)
        if reduction == "none":
            a = acc.reshape(-1).cpu()
            assert ((a == 0) | (a == 1)).all(), a
            assert (a[~keep] == 0).all()
            assert torch.equal(a[clear].bool(), ref_correct[clear]), (
                "per-token accuracy differs off near-ties"
            )
            if pred is not None:
                assert torch.equal(a.bool(), (pred == labels) & keep), (
                    "accuracy disagrees with predicted tokens"
                )
        else:
            n_kept = int(keep.sum())
            ambiguous = int((keep & ~clear).sum()) if n_kept else 0
            a = float(acc)
            assert 0.0 <= a <= 1.0
            if n_kept == 0:
                assert a == 0.0
            else:
                assert abs(a - float(ref["token_accuracy"])) * n_kept <= ambiguous + 1e-4, (
                    a,
                    float(ref["token_accuracy"]),
                    ambiguous,
                )
            if pred is not None and n_kept:
                own = float(((pred == labels) & keep).sum()) / n_kept
                assert abs(a - own) <= 1e-6, f"accuracy {a} disagrees with predicted tokens ({own})"

    # ---- backward
    grad_leaves = case.grad_leaves()
    names = [n for n in upstream if n in got and got[n].requires_grad]
    if not grad_leaves or not names:
        return got
    obj, ref_obj, g_max = 0.0, 0.0, 0.0
    for name in names:
        g = upstream_like(ref[name], gen)
        g_max = max(g_max, float(g.abs().max()) if g.numel() else 0.0)
        ref_obj = ref_obj + (ref[name] * g).sum()
        obj = obj + (got[name] * g.to(got[name].device, got[name].dtype)).sum()
    obj.backward()
    leaves = ref["leaves"]
    ref_grads = torch.autograd.grad(ref_obj, [leaves[k] for k in grad_leaves], allow_unused=True)
    floors = _grad_floors(case, opts, g_max, tol)
    for (name, t), rg in zip(grad_leaves.items(), ref_grads, strict=True):
        assert t.grad is not None, f"grad of {name} is None"
        assert t.grad.dtype == t.dtype, f"grad of {name}: dtype {t.grad.dtype} != {t.dtype}"
        assert_close(
            f"grad {name} (through {'+'.join(names)})",
            t.grad,
            torch.zeros_like(leaves[name]) if rg is None else rg,
            tol,
            floor=floors[name],
        )
    return got


def _grad_floors(case: Case, opts: dict, g_max: float, tol: float) -> dict[str, float]:
    """Per input, a tenth of ``tol`` of the largest gradient a logit gradient of magnitude
    ``g_max * |scale| / denominator`` could give it. A saturated softmax (p = 1 - 4e-5) forms
    p - onehot by cancellation, with an fp32 error of ~eps per logit whatever the (tiny) result:
    this is the scale that error lives on."""
    scale = abs(opts.get("logit_scale") or 1.0)
    if opts.get("class_weight") is not None:
        scale *= float(opts["class_weight"].abs().max())
    denominator = 1.0
    if opts.get("reduction", "mean") == "mean":
        num_items = opts.get("num_items_in_batch")
        denominator = float(num_items) if num_items else max(1, case.n_kept)
    unit = tol / 10 * g_max * scale / denominator
    h = case.hidden.detach().double().reshape(-1, case.hidden.shape[-1]).abs()
    w = case.weight.detach().double().abs()
    return {
        "hidden": unit * float(w.sum(0).max()) if w.numel() else 0.0,
        "weight": unit * float(h.sum(0).max()) if h.numel() else 0.0,
        "bias": unit * h.shape[0],
    }


# ---------------------------------------------------------------- every output, every reduction


@pytest.mark.parametrize("dtype", [FP32, BF16], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_outputs_together(gen, device, chunk_rows, backend, reduction, dtype):
    """Several token chunks of 4 rows (26 = 6 x 4 + 2), z-loss, a bias, mixed ignored tokens."""
    case = make_case(gen, (2, 13), H, V, dtype=dtype, device=device, bias=True)
    check_outputs(
        case,
        gen,
        tol=TOL[dtype],
        dtype=dtype,
        backend=backend,
        reduction=reduction,
        z_loss_scale=1e-2,
        **chunk_rows(4, V),
    )


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("output", [None, *ALL_OUTPUTS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_each_output_alone(gen, device, backend, output, reduction):
    """Also the backward where only the loss gets a gradient (the forward's precomputed gradients)
    for outputs without one."""
    case = make_case(gen, (N,), H, V, device=device, bias=True)
    outputs = () if output is None else (output,)
    check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        outputs=outputs,
        backend=backend,
        reduction=reduction,
        z_loss_scale=2e-2,
        label_smoothing=0.1,
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_through_entropy_alone(gen, device, chunk_rows, backend, reduction):
    """The loss is not used at all: every gradient comes through the entropy."""
    case = make_case(gen, (N,), H, V, device=device, bias=True)
    check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        outputs=("entropy",),
        upstream=("entropy",),
        backend=backend,
        reduction=reduction,
        softcap=4.0,
        logit_scale=1.3,
        **chunk_rows(5, V),
    )


OPTION_SETS = {
    "label_smoothing": dict(label_smoothing=0.2),
    "softcap_scale": dict(softcap=3.0, logit_scale=1.7),
    "negative_scale": dict(logit_scale=-0.8),
    "ignore_index_valid_class": dict(ignore_index=5),
    "num_items": dict(num_items_in_batch=40),
    "class_weight": dict(class_weight=True),
    "token_scaling": dict(use_token_scaling=True, z_loss_scale=1e-2),
    "everything": dict(
        class_weight=True,
        use_token_scaling=True,
        label_smoothing=0.1,
        z_loss_scale=1e-2,
        softcap=5.0,
        logit_scale=0.9,
    ),
}


@pytest.mark.parametrize("opt_id", list(OPTION_SETS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_outputs_with_options(gen, device, chunk_rows, backend, opt_id):
    opts = dict(OPTION_SETS[opt_id])
    ignore_index = opts.pop("ignore_index", -100)
    case = make_case(gen, (N,), H, V, device=device, bias=True, ignore_index=ignore_index)
    if ignore_index == 5:  # a valid class: ignored tokens' labels equal a real class id
        assert case.n_kept < N
    if opts.pop("class_weight", False):
        opts["class_weight"] = class_weights(gen, V, device)
    reduction = "mean" if "num_items_in_batch" in opts else REDUCTIONS[list(OPTION_SETS).index(opt_id) % 3]
    check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        backend=backend,
        reduction=reduction,
        ignore_index=ignore_index,
        **opts,
        **chunk_rows(7, V),
    )


@pytest.mark.parametrize("pattern", IGNORE_PATTERNS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_tokens_everywhere(gen, device, chunk_rows, backend, pattern):
    """Every ignore pattern, with chunk boundaries every 3 rows; the reduction cycles with the
    pattern so each pattern meets one of them (per-token outputs see every position)."""
    reduction = REDUCTIONS[IGNORE_PATTERNS.index(pattern) % 3]
    case = make_case(gen, (N,), H, V, device=device, bias=True, ignore=pattern)
    got = check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        backend=backend,
        reduction=reduction,
        z_loss_scale=1e-2,
        use_token_scaling=pattern == "half",
        **chunk_rows(3, V),
    )
    ignored = case.labels.reshape(-1) == case.ignore_index
    if reduction == "none":
        for name in ("loss", "z_loss", "token_accuracy", "entropy"):
            assert (got[name].reshape(-1)[ignored] == 0).all(), f"{name} nonzero at ignored tokens"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_outputs(gen, device, chunk_rows, monkeypatch, backend, reduction):
    """The two-pass path (token chunks of 5 rows for the loss, vocabulary blocks for grad_W),
    with class weights, label smoothing and token scaling."""
    vocab_passes = record_calls(monkeypatch, chunked, "vocab_pass", lambda a, k, r: 1)
    case = make_case(gen, (31,), H, V, device=device, bias=True)
    check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        backend=backend,
        reduction=reduction,
        class_weight=class_weights(gen, V, device),
        label_smoothing=0.1,
        use_token_scaling=True,
        z_loss_scale=1e-2,
        **chunk_rows(5, V, two_pass=True),
    )
    assert vocab_passes, "the two-pass path did not run"


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_pass_forced_by_tuning(gen, device, monkeypatch, backend):
    vocab_passes = record_calls(monkeypatch, chunked, "vocab_pass", lambda a, k, r: 1)
    case = make_case(gen, (2, 11), H, V, device=device, bias=True)
    check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        backend=backend,
        reduction="none",
        label_smoothing=0.05,
        tuning=Tuning(two_pass=True, chunk_rows=4),
    )
    assert vocab_passes, "Tuning(two_pass=True) did not take the two-pass path"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_outputs_with_options(gen, device, chunk_rows, backend, reduction):
    case = make_case(gen, (N,), H, V, dtype=BF16, device=device, bias=True)
    check_outputs(
        case,
        gen,
        tol=TOL[BF16],
        dtype=BF16,
        backend=backend,
        reduction=reduction,
        class_weight=class_weights(gen, V, device),
        use_token_scaling=True,
        label_smoothing=0.1,
        softcap=5.0,
        **chunk_rows(4, V),
    )


# ---------------------------------------------------------------- nothing kept, no tokens


def _check_all_zero(case, gen, **opts):
    out = call_op(case, **flags(ALL_OUTPUTS), **opts)
    reduction = opts.get("reduction", "mean")
    lead = tuple(case.labels.shape)
    value_shape = lead if reduction == "none" else ()
    for name in ("loss", "z_loss", "token_accuracy", "entropy"):
        t = getattr(out, name)
        assert tuple(t.shape) == value_shape, (name, tuple(t.shape))
        assert torch.isfinite(t).all() and (t == 0).all(), f"{name} must be exactly 0, got {t}"
    assert out.predicted_tokens.dtype == torch.int64 and tuple(out.predicted_tokens.shape) == lead
    assert (out.predicted_tokens == -1).all()
    assert out.loss.requires_grad and out.entropy.requires_grad, "loss and entropy stay attached"
    obj = sum(
        (getattr(out, n) * torch.randn(value_shape, generator=gen).to(out.loss.device)).sum()
        for n in DIFFERENTIABLE
    )
    obj.backward()
    for name, t in case.tensors().items():
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.dtype == t.dtype, name
        assert torch.isfinite(t.grad).all() and (t.grad == 0).all(), f"{name}.grad must be zero"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_ignored(gen, device, chunk_rows, backend, reduction):
    case = make_case(gen, (3, 5), H, V, device=device, bias=True, ignore="all")
    extra = dict(num_items_in_batch=0) if reduction == "mean" else {}
    _check_all_zero(
        case,
        gen,
        backend=backend,
        reduction=reduction,
        z_loss_scale=1e-2,
        label_smoothing=0.1,
        class_weight=class_weights(gen, V, device),
        use_token_scaling=True,
        **extra,
        **chunk_rows(4, V),
    )


@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=str)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(gen, device, backend, reduction, lead):
    case = make_case(gen, lead, H, V, device=device, bias=True)
    _check_all_zero(
        case,
        gen,
        backend=backend,
        reduction=reduction,
        z_loss_scale=1e-2,
        class_weight=class_weights(gen, V, device),
    )


# ---------------------------------------------------------------- class weights


def _dense64(case: Case):
    leaves = {k: t.detach().cpu().double().requires_grad_() for k, t in case.tensors().items()}
    x = F.linear(leaves["hidden"], leaves["weight"], leaves.get("bias"))
    return x, leaves


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_reference_class_weight_matches_torch(gen, reduction, label_smoothing):
    """The reference itself (no op code) against F.cross_entropy(weight=, label_smoothing=)."""
    h = torch.randn(13, 7, generator=gen, dtype=torch.float64)
    w = torch.randn(11, 7, generator=gen, dtype=torch.float64)
    b = torch.randn(11, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 11, (13,), generator=gen)
    y[[0, 5, 12]] = -100
    cw = torch.rand(11, generator=gen, dtype=torch.float64) + 0.1
    loss, z = reference_flce(
        h, w, y, b, reduction=reduction, label_smoothing=label_smoothing, class_weight=cw
    )
    expected = F.cross_entropy(
        F.linear(h, w, b), y, weight=cw, reduction=reduction, label_smoothing=label_smoothing
    )
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(z, torch.zeros_like(z))
    # and a uniform class weight is no class weight
    plain, _ = reference_flce(h, w, y, b, reduction=reduction, label_smoothing=label_smoothing)
    ones, _ = reference_flce(
        h,
        w,
        y,
        b,
        reduction=reduction,
        label_smoothing=label_smoothing,
        class_weight=torch.ones(11, dtype=torch.float64),
    )
    torch.testing.assert_close(ones, plain, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weight_matches_torch_cross_entropy(
    gen, device, chunk_rows, backend, reduction, label_smoothing
):
    """The op against F.cross_entropy in fp64 (values and gradients): a second oracle. Some classes
    have weight 0, and some kept tokens have such labels."""
    case = make_case(gen, (N,), H, V, device=device, bias=True)
    labels = case.labels.reshape(-1)
    kept_labels = labels[labels != -100]
    cw = class_weights(gen, V, device, zero=(int(kept_labels[0]), 7))
    loss = call_op(
        case,
        backend=backend,
        reduction=reduction,
        label_smoothing=label_smoothing,
        class_weight=cw,
        **chunk_rows(6, V),
    )
    x, leaves = _dense64(case)
    expected = F.cross_entropy(
        x, case.labels.cpu(), weight=cw.cpu().double(), reduction=reduction, label_smoothing=label_smoothing
    )
    assert_close("loss", loss, expected, TOL[FP32])
    g = upstream_like(expected, gen)
    (loss * g.to(loss.device, loss.dtype)).sum().backward()
    grads = torch.autograd.grad((expected * g).sum(), list(leaves.values()))
    for (name, t), rg in zip(case.tensors().items(), grads, strict=True):
        assert_close(f"grad {name}", t.grad, rg, TOL[FP32])


@pytest.mark.parametrize(
    "opts",
    [
        dict(num_items_in_batch=37),
        dict(num_items_in_batch=("tensor", 29.5)),
        dict(z_loss_scale=2e-2),
        dict(z_loss_scale=2e-2, label_smoothing=0.2, num_items_in_batch=("tensor", 41)),
        dict(z_loss_scale=2e-2, reduction="sum"),
        dict(z_loss_scale=2e-2, reduction="none", label_smoothing=0.1),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weight_with_num_items_and_z_loss(gen, device, chunk_rows, backend, opts):
    opts = dict(opts)
    n = opts.get("num_items_in_batch")
    if isinstance(n, tuple):
        opts["num_items_in_batch"] = torch.tensor(n[1], device=device)
    case = make_case(gen, (N,), H, V, device=device, bias=True)
    check_outputs(
        case,
        gen,
        tol=TOL[FP32],
        outputs=("z_loss",),
        backend=backend,
        class_weight=class_weights(gen, V, device),
        **opts,
        **chunk_rows(8, V),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weight_divisor_is_weight_sum(gen, device, backend):
    """The "mean" divisor is the kept tokens' summed label weights: scaling every class weight by
    a constant leaves the mean unchanged (the z-loss, not class-weighted, scales inversely)."""
    case = make_case(gen, (N,), H, V, device=device)
    cw = class_weights(gen, V, device)
    a = call_op(case, backend=backend, class_weight=cw, label_smoothing=0.2)
    b = call_op(case, backend=backend, class_weight=cw * 4.0, label_smoothing=0.2)
    assert_close("mean loss with 4x class weights", b, a.detach(), 1e-5)
    s = call_op(case, backend=backend, class_weight=cw, label_smoothing=0.2, reduction="sum")
    y = case.labels[case.labels != -100]
    assert_close("sum / mean", s / a, cw[y].sum(), 1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weight_other_float_dtypes(gen, device, backend, dtype):
    case = make_case(gen, (N,), H, V, device=device)
    cw = class_weights(gen, V, device).to(dtype)
    check_outputs(
        case, gen, tol=TOL[FP32], outputs=("entropy",), backend=backend, class_weight=cw, label_smoothing=0.1
    )


@pytest.mark.parametrize("extra", [dict(z_loss_scale=1e-2), dict(label_smoothing=0.1)], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_class_weight_zero_divisor_gives_zero(gen, device, backend, extra):
    """Every kept token's label has class weight 0: the specified rule is that a zero divisor gives
    a loss of exactly 0 (F.cross_entropy gives NaN). Without z-loss and smoothing the sum is 0
    anyway; with either it is not."""
    case = make_case(gen, (N,), H, V, device=device)
    y = case.labels[case.labels != -100]
    cw = class_weights(gen, V, device, zero=sorted(set(y.tolist())))
    plain = call_op(case, backend=backend, class_weight=cw)
    assert torch.isfinite(plain) and plain.item() == 0.0, plain
    assert reference_outputs_for(case, class_weight=cw, **extra)["loss"].item() == 0.0
    loss = call_op(case, backend=backend, class_weight=cw, **extra)
    assert torch.isfinite(loss) and loss.item() == 0.0, f"zero divisor: loss {loss.item()}, expected 0"


BAD_CLASS_WEIGHTS = {
    "too_long": (lambda: torch.rand(V + 1), ValueError),
    "two_dims": (lambda: torch.rand(1, V), ValueError),
    "scalar": (lambda: torch.tensor(1.0), ValueError),
    "int": (lambda: torch.ones(V, dtype=torch.int64), TypeError),
    "bool": (lambda: torch.ones(V, dtype=torch.bool), TypeError),
    "requires_grad": (lambda: torch.rand(V).requires_grad_(), ValueError),
    "list": (lambda: [1.0] * V, TypeError),
    "other_device": (lambda: torch.rand(V, device="meta"), ValueError),
}


@pytest.mark.parametrize("bad", list(BAD_CLASS_WEIGHTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_class_weight(gen, backend, bad):
    make, error = BAD_CLASS_WEIGHTS[bad]
    case = make_case(gen, (5,), H, V)
    with pytest.raises(error, match="class_weight"):
        call_op(case, backend=backend, class_weight=make())


# ---------------------------------------------------------------- token scaling (TRL dft)


def _trl_dft(case: Case, reduction: str, z_loss_scale: float, num_items=None):
    """TRL's loss_type="dft" on dense fp64 logits: -p_y.detach() * log p_y per kept token (plus the
    z-loss term, scaled the same way), summed, / num_items_in_batch (default: tokens kept)."""
    x, leaves = _dense64(case)
    y = case.labels.reshape(-1).cpu()
    keep = y != case.ignore_index
    logp = torch.log_softmax(x.reshape(-1, x.shape[-1]), dim=-1).gather(1, torch.where(keep, y, 0)[:, None])[
        :, 0
    ]
    lse = torch.logsumexp(x.reshape(-1, x.shape[-1]), dim=-1)
    scale = logp.exp().detach()
    per_token = torch.where(keep, -scale * logp + scale * z_loss_scale * lse**2, 0.0)
    per_z = torch.where(keep, scale * z_loss_scale * lse**2, 0.0)
    if reduction == "none":
        return per_token.reshape(case.labels.shape), per_z.reshape(case.labels.shape), leaves
    if reduction == "sum":
        return per_token.sum(), per_z.sum(), leaves
    den = float(num_items) if num_items is not None else float(keep.sum())
    return per_token.sum() / den, per_z.sum() / den, leaves


@pytest.mark.parametrize("z_loss_scale", [0.0, 2e-2])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_token_scaling_matches_trl_dft(gen, device, chunk_rows, backend, reduction, z_loss_scale):
    case = make_case(gen, (2, 13), H, V, device=device, bias=True)
    num_items = 33 if reduction == "mean" and z_loss_scale else None
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    loss, z = call_op(
        case,
        backend=backend,
        reduction=reduction,
        use_token_scaling=True,
        z_loss_scale=z_loss_scale,
        return_z_loss=True,
        **extra,
        **chunk_rows(4, V),
    )
    expected, expected_z, leaves = _trl_dft(case, reduction, z_loss_scale, num_items)
    assert_close("loss", loss, expected, TOL[FP32])
    assert_close("z_loss", z, expected_z, TOL[FP32])
    # the token scale changes the loss: the check above could not pass for an unscaled loss
    unscaled = reference_flce(
        *(t.detach().double() for t in (case.hidden, case.weight)),
        case.labels,
        case.bias.detach().double(),
        reduction=reduction,
        z_loss_scale=z_loss_scale,
        **extra,
    )[0]
    assert not torch.allclose(unscaled.cpu(), expected.cpu())
    g = upstream_like(expected, gen)
    (loss * g.to(loss.device, loss.dtype)).sum().backward()
    grads = torch.autograd.grad((expected * g).sum(), list(leaves.values()))
    for (name, t), rg in zip(case.tensors().items(), grads, strict=True):
        assert_close(f"grad {name}", t.grad, rg, TOL[FP32])


def test_reference_token_scaling_matches_trl(gen):
    h = torch.randn(9, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(13, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 13, (9,), generator=gen)
    y[[2, 8]] = -100
    logp = torch.log_softmax(h @ w.T, -1)
    keep = y != -100
    lp_y = logp[keep].gather(1, y[keep, None])[:, 0]
    loss, _ = reference_flce(h, w, y, use_token_scaling=True, num_items_in_batch=11)
    torch.testing.assert_close(loss, (-lp_y.exp() * lp_y).sum() / 11, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- argmax ties


def _tie_case(device, dtype, *, bias: bool):
    """Dyadic inputs (exact in bf16, every partial sum exact): tokens of group g have hidden
    feature g equal to 8, and the weight rows of group g's tied classes have 2 there (the others
    0), so those classes share the largest logit exactly. Groups: (10, 11) in one column block,
    (3, 70) across blocks, and (20, 64, 96) three-way up to the last class."""
    g = torch.Generator().manual_seed(1234)
    groups = [(10, 11), (3, 70), (20, 64, 96)]
    n_sel, H_ = len(groups), 19
    rest = H_ - n_sel
    W = torch.randint(-1, 2, (V, H_), generator=g).float() * 0.25
    W[:, :n_sel] = 0.0
    for k, cls in enumerate(groups):
        W[list(cls)] = W[cls[0]].clone()  # identical rows: identical logits whatever the summation order
        W[list(cls), k] = 2.0
    n = 21
    hid = torch.randint(-2, 3, (n, H_), generator=g).float() * 0.5
    hid[:, :n_sel] = 0.0
    group_of = torch.arange(n) % n_sel
    hid[torch.arange(n), group_of] = 8.0
    b = None
    if bias:
        b = torch.randint(-4, 5, (V,), generator=g).float() * 0.25
        for cls in groups:
            b[list(cls)] = b[cls[0]].clone()
    expected = torch.tensor([groups[k][0] for k in group_of.tolist()])
    labels = torch.tensor([groups[k][-1] if i % 2 else groups[k][0] for i, k in enumerate(group_of.tolist())])
    labels[0] = -100
    expected[0] = -1
    assert rest > 0

    def prep(t):
        return None if t is None else t.to(dtype).to(device).requires_grad_()

    case = Case(prep(hid), prep(W), labels.to(device), prep(b), -100)
    # the tied logits are the maximum, exactly equal, in fp64
    z = reference_token_outputs(case.hidden.detach(), case.weight.detach(), labels, case.bias)[3]
    for i, k in enumerate(group_of.tolist()):
        top = z[i, list(groups[k])]
        assert (top == top[0]).all() and top[0] > z[i].max() - 1e-12 and top2_gap(z[i : i + 1])[0] == 0
    return case, expected, labels


@pytest.mark.parametrize("variant", ["fp32", "bf16", "bias_softcap_scale", "chunked_none"], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_ties_take_the_first_index(device, chunk_rows, backend, variant):
    dtype = BF16 if variant == "bf16" else FP32
    case, expected, labels = _tie_case(device, dtype, bias=variant == "bias_softcap_scale")
    opts = dict(softcap=30.0, logit_scale=0.5) if variant == "bias_softcap_scale" else {}
    if variant == "chunked_none":
        opts.update(reduction="none", **chunk_rows(4, V))
    out = call_op(case, backend=backend, return_token_accuracy=True, return_predicted_tokens=True, **opts)
    assert out.predicted_tokens.cpu().tolist() == expected.tolist()
    correct = (labels == expected) & (labels != -100)
    if variant == "chunked_none":
        assert out.token_accuracy.cpu().tolist() == correct.float().tolist()
    else:
        assert float(out.token_accuracy) == pytest.approx(
            float(correct.sum()) / int((labels != -100).sum()), abs=1e-6
        )
    math_opts = {k: v for k, v in opts.items() if k in ("softcap", "logit_scale", "reduction")}
    ref = reference_outputs(case.hidden.detach(), case.weight.detach(), labels, case.bias, **math_opts)
    assert ref.predicted_tokens.tolist() == expected.tolist()  # the reference breaks ties the same way


# ---------------------------------------------------------------- the named tuple


def test_named_tuple_every_combination(gen):
    import itertools

    case = make_case(gen, (6,), 5, 9, requires_grad=())
    for k in range(len(ALL_OUTPUTS) + 1):
        for names in itertools.combinations(ALL_OUTPUTS, k):
            out = call_op(case, backend="torch", **flags(names))
            if not names:
                assert isinstance(out, torch.Tensor)
                continue
            assert isinstance(out, tuple) and type(out).__name__ == "FusedLossOutput"
            assert out._fields == ("loss", *names), (names, out._fields)
            assert out[0] is out.loss
            for i, name in enumerate(names, start=1):
                assert out[i] is getattr(out, name)
            loss, *rest = out
            assert len(rest) == k
            assert set(out._asdict()) == {"loss", *names}


@pytest.mark.parametrize("backend", BACKENDS)
def test_named_tuple_unpacking(gen, device, backend):
    case = make_case(gen, (2, 5), H, V, device=device, bias=True)
    loss, z_loss = call_op(case, backend=backend, z_loss_scale=1e-2, return_z_loss=True)
    plain = call_op(case, backend=backend, z_loss_scale=1e-2)
    explicit_off = call_op(
        case,
        backend=backend,
        z_loss_scale=1e-2,
        return_z_loss=False,
        return_entropy=False,
        return_token_accuracy=False,
        return_predicted_tokens=False,
    )
    assert isinstance(plain, torch.Tensor) and isinstance(explicit_off, torch.Tensor)
    assert torch.equal(loss.detach(), plain.detach()) and torch.equal(plain.detach(), explicit_off.detach())
    assert 0 < z_loss.item() < loss.item()
    out = call_op(case, backend=backend, return_entropy=True, return_token_accuracy=True)
    loss2, acc, ent = out
    assert out._fields == ("loss", "token_accuracy", "entropy")
    assert torch.equal(loss2.detach(), call_op(case, backend=backend).detach())
    assert acc is out.token_accuracy and ent is out.entropy
    assert ent.requires_grad and not acc.requires_grad


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(gen, device, chunk_rows, backend):
    """hidden stored transposed, labels strided, weight transposed, class weights strided and
    expanded (stride 0)."""
    h_base = torch.randn(H, N, generator=gen).to(device).requires_grad_()
    wt_base = (torch.randn(H, V, generator=gen) * 0.5).to(device).requires_grad_()
    y_base = torch.randint(0, V, (2 * N,), generator=gen)
    y_base[[1, 9, 2 * N - 1]] = -100
    hidden, weight, labels = h_base.t(), wt_base.t(), y_base.to(device)[1::2]
    assert not (hidden.is_contiguous() or weight.is_contiguous() or labels.is_contiguous())
    cw_base = class_weights(gen, 2 * V, device)
    for cw in (cw_base[::2], torch.tensor(1.7, device=device).expand(V)):
        assert not cw.is_contiguous()
        out = lp.fused_linear_cross_entropy(
            hidden,
            weight,
            labels,
            backend=backend,
            reduction="none",
            class_weight=cw,
            label_smoothing=0.1,
            return_entropy=True,
            return_predicted_tokens=True,
            **chunk_rows(4, V),
        )
        hr = hidden.detach().cpu().double().requires_grad_()
        wr = weight.detach().cpu().double().requires_grad_()
        ref, _ = reference_flce(
            hr, wr, labels.cpu(), reduction="none", class_weight=cw.cpu().double(), label_smoothing=0.1
        )
        tok = reference_token_outputs(hr, wr, labels.cpu())
        assert_close("loss", out.loss, ref, TOL[FP32])
        assert_close("entropy", out.entropy, tok.entropy, TOL[FP32])
        assert torch.equal(out.predicted_tokens.cpu(), tok.predicted)
        g1, g2 = (torch.randn(N, generator=gen, dtype=torch.float64) for _ in range(2))
        h_base.grad = wt_base.grad = None
        (out.loss * g1.float().to(device) + out.entropy * g2.float().to(device)).sum().backward()
        rh, rw = torch.autograd.grad((ref * g1 + tok.entropy * g2).sum(), [hr, wr])
        assert_close("grad hidden", h_base.grad.t(), rh, TOL[FP32])
        assert_close("grad weight", wt_base.grad.t(), rw, TOL[FP32])


# ---------------------------------------------------------------- property test


@st.composite
def output_specs(draw):
    backend = draw(st.sampled_from(BACKENDS))
    big = backend == "torch"
    lead = tuple(
        draw(st.lists(st.integers(0 if draw(st.booleans()) else 1, 9 if big else 6), min_size=1, max_size=2))
    )
    spec = dict(
        backend=backend,
        lead=lead,
        H=draw(st.integers(1, 24)),
        # V >= 2: with V = 1 every gradient is 0 up to rounding (test_fuzz covers it, with a
        # tolerance for cancellation that this file's relative one does not have)
        V=draw(st.integers(2, 90 if big else 70)),
        dtype=draw(st.sampled_from([FP32, FP32, BF16])),
        bias=draw(st.booleans()),
        ignore=draw(st.sampled_from([*IGNORE_PATTERNS, "all", "mixed"])),
        reduction=draw(st.sampled_from(REDUCTIONS)),
        outputs=tuple(n for n in ALL_OUTPUTS if draw(st.booleans())),
        label_smoothing=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),
        z_loss_scale=draw(st.sampled_from([0.0, 1e-2])),
        softcap=draw(st.sampled_from([None, None, 2.0, 7.0])),
        logit_scale=draw(st.sampled_from([None, None, 0.6, -1.4])),
        class_weight=draw(st.booleans()),
        use_token_scaling=draw(st.booleans()),
        chunk=draw(st.sampled_from([None, 2, 3])),
        two_pass=draw(st.booleans()),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    spec["num_items"] = draw(st.sampled_from([None, 19])) if spec["reduction"] == "mean" else None
    return spec


@examples(0.1)
@given(spec=output_specs())
def test_outputs_property(spec):
    """Random small shapes, options and output sets against the reference (values, gradients)."""
    gen = torch.Generator().manual_seed(spec["seed"])
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    V_ = spec["V"]
    case = make_case(
        gen,
        spec["lead"],
        spec["H"],
        V_,
        dtype=spec["dtype"],
        device=device,
        bias=spec["bias"],
        ignore=spec["ignore"],
    )
    opts = dict(
        backend=spec["backend"],
        reduction=spec["reduction"],
        label_smoothing=spec["label_smoothing"],
        z_loss_scale=spec["z_loss_scale"],
        softcap=spec["softcap"],
        logit_scale=spec["logit_scale"],
        use_token_scaling=spec["use_token_scaling"],
    )
    if spec["class_weight"]:
        opts["class_weight"] = class_weights(gen, V_, device)
    if spec["num_items"] is not None:
        opts["num_items_in_batch"] = spec["num_items"]
    if spec["chunk"] is not None:
        rows = spec["chunk"]
        opts["tuning"] = Tuning(chunk_rows=rows, two_pass=spec["two_pass"] or None)
    check_outputs(
        case,
        gen,
        tol=TOL[spec["dtype"]],
        dtype=spec["dtype"],
        outputs=spec["outputs"],
        strict_ties=False,
        **opts,
    )


def test_gap_tolerance_is_not_vacuous():
    """Sanity of the near-tie rule used above: a far-from-maximal pick is rejected."""
    z = torch.tensor([[0.0, 3.0, 2.99], [1.0, -1.0, 0.5]], dtype=torch.float64)
    assert near_max(z, torch.tensor([2, 0]), 0.05).tolist() == [True, True]
    assert near_max(z, torch.tensor([0, 2]), 0.05).tolist() == [False, False]
    assert math.isclose(float(top2_gap(z)[0]), 0.01, abs_tol=1e-12)
