"""The Triton row kernel's ``row_io`` records against the PyTorch row kernel (``torch_ce``).

Class weights (with and without label smoothing), the per-row outputs (argmax, entropy, token
scale) alone and together, the entropy's gradient (whole rows, with ``lse_in``, in column
blocks), the gradient written over the logits (same dtype, or a narrower view of fp32 logits),
both directions of pass 2, and log-sum-exp partials from the fused logits GEMM. Under the
interpreter the kernel walks rows in blocks of 64 columns (``launch_config``), so V = 97 and
V = 131 span two and three blocks, the last one part-filled. Rows 0, 3 and 6 of 7 are ignored.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import call_rows

from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import ClassWeight, EntropyGrad, RowOutputs
from liger_patch.ops.cross_entropy.rows import ce_rows_torch

rows_mod = pytest.importorskip("liger_patch.ops.cross_entropy.triton.rows")
ce_rows_triton = rows_mod.ce_rows_triton

ROWS = 7
IGNORED = (0, 3, 6)  # first, middle, last
ALL_OUTPUTS = ("argmax", "entropy", "token_scale")
SOFT = dict(softcap=5.0, logit_scale=0.7)


def _logits(gen, vocab, dtype, device, rows=ROWS):
    return (torch.randn(rows, vocab, generator=gen) * 3.0).to(dtype).to(device)


def _labels(gen, vocab, device, rows=ROWS, ignored=IGNORED):
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[list(ignored)] = -100
    return labels.to(device)


def _class_weight(gen, vocab, device):
    w = (torch.rand(vocab, generator=gen) * 1.5 + 0.25).to(device)
    return ClassWeight(w, w.sum())


def _coefs(gen, device, rows=ROWS):
    return (
        (torch.rand(rows, generator=gen) + 0.5).to(device),
        (torch.rand(rows, generator=gen) + 0.5).to(device),
    )


def _entropy_grad(gen, device, rows=ROWS):
    return EntropyGrad(
        torch.randn(rows, generator=gen).to(device), (torch.rand(rows, generator=gen) * 3).to(device)
    )


def _outputs(names, rows, device):
    """A fresh record, pre-filled with garbage so that every unwritten element shows."""
    if not names:
        return None
    return RowOutputs(
        argmax=torch.full((rows,), 12345, dtype=torch.int64, device=device) if "argmax" in names else None,
        entropy=torch.full((rows,), float("nan"), device=device) if "entropy" in names else None,
        token_scale=torch.full((rows,), float("nan"), device=device) if "token_scale" in names else None,
    )


def _run(fn, logits, labels, opts, *, grad=None, outputs=(), in_place=False, **kwargs):
    """One call of ``fn`` on its own copies: ``grad`` is None (forward only), a dtype, or "view"
    (a bf16 view of the fp32 logits' bytes, as ``gemm.grad_view`` makes it)."""
    logits = logits.clone()
    out = _outputs(outputs, logits.shape[0], logits.device)
    g = None
    if grad == "view":
        g = logits.view(torch.bfloat16)[:, : logits.shape[1]]
    elif in_place:
        g = logits
    elif grad is not None:
        g = torch.full(logits.shape, float("nan"), dtype=grad, device=logits.device)
    ce, lse = call_rows(fn, logits, labels, opts, grad=g, outputs=out, **kwargs)
    return {
        "ce": ce,
        "lse": lse,
        "grad": None if g is None else g.clone(),
        **(
            {}
            if out is None
            else {k: v for k, v in zip(ALL_OUTPUTS, out.tensors(), strict=True) if v is not None}
        ),
    }


def _close(name, got, ref, rtol, atol_frac):
    atol = atol_frac * max(float(ref.abs().max()), 1e-3) if ref.numel() else 0.0
    torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _assert_same(got, ref, *, grad_tol=1e-5):
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        g = got[name]
        if r is None:
            assert g is None, name
        elif name == "argmax":
            assert g.dtype == torch.int64
            assert torch.equal(g.cpu(), r.cpu()), f"argmax {g.tolist()} != {r.tolist()}"
        elif name == "grad":
            assert g.dtype == r.dtype
            _close(name, g.float(), r.float(), grad_tol, grad_tol)
        else:
            _close(name, g, r, 1e-5, 1e-5)


def _compare(logits, labels, opts, *, grad_tol=None, **kwargs):
    ref = _run(ce_rows_torch, logits, labels, opts, **kwargs)
    got = _run(ce_rows_triton, logits, labels, opts, **kwargs)
    if grad_tol is None:
        narrow = kwargs.get("grad") in (torch.bfloat16, "view") or logits.dtype == torch.bfloat16
        grad_tol = 1e-2 if narrow and kwargs.get("grad") is not None else 1e-5
    _assert_same(got, ref, grad_tol=grad_tol)
    return got, ref


# (id, options, class weights, outputs, entropy grad, logits dtype, V)
CASES = [
    ("cw", {}, True, (), False, torch.float32, 97),
    ("cw_smoothing", dict(label_smoothing=0.1), True, (), False, torch.float32, 131),
    (
        "cw_smoothing_soft_z",
        dict(label_smoothing=0.2, z_loss_scale=1e-2, **SOFT),
        True,
        (),
        False,
        torch.float32,
        131,
    ),
    ("cw_soft_bf16", dict(**SOFT), True, (), False, torch.bfloat16, 131),
    ("argmax", dict(**SOFT), False, ("argmax",), False, torch.float32, 97),
    ("entropy", dict(label_smoothing=0.1), False, ("entropy",), False, torch.float32, 131),
    ("token_scale", dict(z_loss_scale=1e-2), False, ("token_scale",), False, torch.float32, 97),
    (
        "token_scale_cw_smoothing",
        dict(label_smoothing=0.1, z_loss_scale=1e-2),
        True,
        ("token_scale",),
        False,
        torch.float32,
        131,
    ),
    ("entropy_grad", dict(**SOFT), False, (), True, torch.float32, 131),
    (
        "everything",
        dict(label_smoothing=0.1, z_loss_scale=1e-2, **SOFT),
        True,
        ALL_OUTPUTS,
        True,
        torch.float32,
        131,
    ),
    (
        "everything_bf16",
        dict(label_smoothing=0.1, z_loss_scale=1e-2, **SOFT),
        True,
        ALL_OUTPUTS,
        True,
        torch.bfloat16,
        97,
    ),
]


# a sweep: every option set with every set of records, in both logits dtypes
SWEEP_OPTIONS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "soft_z_smoothing": dict(label_smoothing=0.05, z_loss_scale=1e-3, **SOFT),
}
SWEEP_RECORDS = {
    "cw": (True, (), False),
    "outputs": (False, ALL_OUTPUTS, False),
    "eg": (False, (), True),
    "cw_argmax_eg": (True, ("argmax",), True),
    "cw_outputs_eg": (True, ALL_OUTPUTS, True),
}
CASES += [
    (
        f"{o}-{r}-{str(dtype)[6:]}",
        SWEEP_OPTIONS[o],
        *SWEEP_RECORDS[r],
        dtype,
        131 if dtype == torch.float32 else 97,
    )
    for o in SWEEP_OPTIONS
    for r in SWEEP_RECORDS
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch(gen, device, case):
    _, options, with_cw, outputs, with_eg, dtype, vocab = case
    opts = LossOptions(**options)
    logits = _logits(gen, vocab, dtype, device)
    labels = _labels(gen, vocab, device)
    cw = _class_weight(gen, vocab, device) if with_cw else None
    coef_ce, coef_z = _coefs(gen, device)
    eg = _entropy_grad(gen, device) if with_eg else None
    # the forward alone (outputs without a gradient still run pass 2), then with the gradient
    _compare(logits, labels, opts, class_weight=cw, outputs=outputs)
    got, ref = _compare(
        logits,
        labels,
        opts,
        grad=dtype,
        coef_ce=coef_ce,
        coef_z=coef_z,
        class_weight=cw,
        outputs=outputs,
        entropy_grad=eg,
    )
    for name in outputs:
        assert (got[name][list(IGNORED)] == (-1 if name == "argmax" else 0)).all(), name
    assert (got["grad"][list(IGNORED)] == 0).all()


def test_all_ignored_chunk(gen, device):
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, **SOFT)
    logits = _logits(gen, 97, torch.float32, device)
    labels = torch.full((ROWS,), -100, device=device)
    coef_ce, coef_z = _coefs(gen, device)
    got, _ = _compare(
        logits,
        labels,
        opts,
        grad=torch.float32,
        coef_ce=coef_ce,
        coef_z=coef_z,
        class_weight=_class_weight(gen, 97, device),
        outputs=ALL_OUTPUTS,
        entropy_grad=_entropy_grad(gen, device),
    )
    assert (got["argmax"] == -1).all() and (got["entropy"] == 0).all() and (got["token_scale"] == 0).all()
    assert (got["ce"] == 0).all() and (got["lse"] == 0).all() and (got["grad"] == 0).all()


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_column_blocks_with_lse_in(gen, device, smoothing):
    """The backward of wider rows, block by block, with the forward's lse: class weights (the
    label's weight whether or not the label is in the block) and the entropy's gradient."""
    vocab = 197
    opts = LossOptions(label_smoothing=smoothing, z_loss_scale=1e-2, **SOFT)
    logits = _logits(gen, vocab, torch.float32, device)
    labels = _labels(gen, vocab, device)
    labels[1], labels[2] = 5, 150  # one label in each block
    cw = _class_weight(gen, vocab, device)
    coef_ce, coef_z = _coefs(gen, device)
    eg = _entropy_grad(gen, device)
    _, lse = call_rows(ce_rows_torch, logits, labels, opts)
    kw = dict(coef_ce=coef_ce, coef_z=coef_z, class_weight=cw, entropy_grad=eg, lse_in=lse)
    full = _compare(logits, labels, opts, grad=torch.float32, **kw)[1]["grad"]  # whole rows, with lse_in
    pieces = []
    for start, stop in ((0, 70), (70, vocab)):  # 70 and 127 columns: one and two kernel blocks
        block = logits[:, start:stop]
        got, ref = _compare(
            block, labels, opts, grad=torch.float32, col_offset=start, vocab_total=vocab, **kw
        )
        assert got["ce"] is None and got["lse"] is lse
        pieces.append(got["grad"])
    _close("blocks", torch.cat(pieces, dim=1), full, 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grad_written_over_the_logits(gen, device, dtype):
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, **SOFT)
    logits = _logits(gen, 131, dtype, device)
    labels = _labels(gen, 131, device)
    coef_ce, coef_z = _coefs(gen, device)
    _compare(
        logits,
        labels,
        opts,
        in_place=True,
        coef_ce=coef_ce,
        coef_z=coef_z,
        class_weight=_class_weight(gen, 131, device),
        outputs=ALL_OUTPUTS,
        entropy_grad=_entropy_grad(gen, device),
        grad_tol=1e-2 if dtype == torch.bfloat16 else 1e-5,
    )


@pytest.mark.parametrize("reverse", [True, False], ids=["reverse", "forward"])
def test_bf16_grad_over_fp32_logits(gen, device, reverse):
    """The gradient as a bf16 view of the fp32 logits' bytes: pass 2 must read each block before
    its stores land (forwards, whatever the tuning asks)."""
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, tuning=Tuning(reverse_pass2=reverse), **SOFT)
    logits = _logits(gen, 131, torch.float32, device)
    labels = _labels(gen, 131, device)
    coef_ce, coef_z = _coefs(gen, device)
    _compare(
        logits,
        labels,
        opts,
        grad="view",
        coef_ce=coef_ce,
        coef_z=coef_z,
        class_weight=_class_weight(gen, 131, device),
        outputs=ALL_OUTPUTS,
        entropy_grad=_entropy_grad(gen, device),
    )


def test_forward_pass2_matches_reverse(gen, device):
    opts = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, **SOFT)
    forward = LossOptions(label_smoothing=0.1, z_loss_scale=1e-2, tuning=Tuning(reverse_pass2=False), **SOFT)
    logits = _logits(gen, 131, torch.float32, device)
    labels = _labels(gen, 131, device)
    coef_ce, coef_z = _coefs(gen, device)
    kw = dict(
        grad=torch.float32,
        coef_ce=coef_ce,
        coef_z=coef_z,
        class_weight=_class_weight(gen, 131, device),
        outputs=ALL_OUTPUTS,
        entropy_grad=_entropy_grad(gen, device),
    )
    got = _compare(logits, labels, forward, **kw)[0]
    _assert_same(got, _run(ce_rows_triton, logits, labels, opts, **kw))


def _tie_logits(gen, device, vocab=131):
    """Rows whose largest value occurs more than once: in two blocks, within a block and in the
    last, in all three blocks, and everywhere."""
    x = torch.randn(6, vocab, generator=gen)
    top = 9.0
    for row, cols in enumerate(((5, 70), (70, 129), (3, 10, 130), (2, 64, 128), (127, 128))):
        x[row, list(cols)] = top
    x[5] = 1.5
    return x.to(device)


@pytest.mark.parametrize("reverse", [True, False], ids=["reverse", "forward"])
def test_argmax_ties_take_the_first_column(gen, device, reverse):
    opts = LossOptions(tuning=Tuning(reverse_pass2=reverse), **SOFT)
    logits = _tie_logits(gen, device)
    labels = torch.randint(0, 131, (6,), generator=gen).to(device)
    expected = [5, 70, 3, 2, 127, 0]
    for grad in (None, torch.float32):
        coefs = _coefs(gen, device, rows=6) if grad is not None else (None, None)
        got = _compare(
            logits, labels, opts, grad=grad, coef_ce=coefs[0], coef_z=coefs[1], outputs=("argmax",)
        )[0]
        assert got["argmax"].tolist() == expected


def test_through_logits_partials(gen, device):
    """Partials from the fused logits GEMM replace pass 1; argmax and entropy still come from
    pass 2 with their lse. Class weights without label smoothing may use them; smoothing without
    class weights too. (fp32 under the interpreter, bf16 on a GPU that runs the GEMM.)"""
    triton_logits = pytest.importorskip("liger_patch.ops.core.triton.logits")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    # TMA needs 16-byte rows; under the interpreter 5 GEMM tiles of 32 columns, 3 kernel blocks
    rows, hdim, vocab = ROWS, 24, 136
    h = torch.randn(rows, hdim, generator=gen).to(dtype).to(device)
    w = (torch.randn(vocab, hdim, generator=gen) * 0.6).to(dtype).to(device)
    if not triton_logits.supported(h, w, dtype, Tuning()):
        pytest.skip("no fused logits GEMM on this device (test_logits.py covers where it runs)")
    labels = _labels(gen, vocab, device)
    cw = _class_weight(gen, vocab, device)
    coef_ce, coef_z = _coefs(gen, device)
    for opts, class_weight in (
        (LossOptions(z_loss_scale=1e-2, **SOFT), cw),
        (LossOptions(label_smoothing=0.1, **SOFT), None),
    ):
        logits = torch.empty(rows, vocab, dtype=dtype, device=device)
        partials = triton_logits.logits_with_partials(h, w, None, opts, logits)
        kw = dict(
            coef_ce=coef_ce,
            coef_z=coef_z,
            class_weight=class_weight,
            outputs=ALL_OUTPUTS,
            entropy_grad=_entropy_grad(gen, device),
        )
        grad_tol = 1e-5 if dtype == torch.float32 else 1e-2
        ref = _run(ce_rows_torch, logits, labels, opts, grad=dtype, **kw)
        got = _run(ce_rows_triton, logits, labels, opts, grad=dtype, partials=partials, **kw)
        _assert_same(got, ref, grad_tol=grad_tol)
        forward_only = dict(partials=partials, outputs=ALL_OUTPUTS)
        got = _run(ce_rows_triton, logits, labels, opts, **forward_only)
        _assert_same(got, _run(ce_rows_torch, logits, labels, opts, outputs=ALL_OUTPUTS))


def test_outputs_in_strided_buffers(gen, device):
    """Output tensors that are views (every other element) are written through a copy."""
    logits = _logits(gen, 97, torch.float32, device)
    labels = _labels(gen, 97, device)
    buffers = {
        "argmax": torch.full((2 * ROWS,), 7, dtype=torch.int64, device=device),
        "entropy": torch.full((2 * ROWS,), float("nan"), device=device),
        "token_scale": torch.full((2 * ROWS,), float("nan"), device=device),
    }
    out = RowOutputs(**{k: v[::2] for k, v in buffers.items()})
    ref = RowOutputs(
        torch.empty(ROWS, dtype=torch.int64, device=device),
        torch.empty(ROWS, device=device),
        torch.empty(ROWS, device=device),
    )
    call_rows(ce_rows_triton, logits, labels, LossOptions(), outputs=out)
    call_rows(ce_rows_torch, logits, labels, LossOptions(), outputs=ref)
    for name, r in zip(ALL_OUTPUTS, ref.tensors(), strict=True):
        _assert_same({name: buffers[name][::2]}, {name: r})
        untouched = buffers[name][1::2]
        assert (untouched == 7).all() if name == "argmax" else untouched.isnan().all(), name


def test_refused(gen, device):
    vocab = 97
    logits = _logits(gen, vocab, torch.float32, device)
    labels = _labels(gen, vocab, device)
    cw = _class_weight(gen, vocab, device)
    lse = call_rows(ce_rows_torch, logits, labels, LossOptions())[1]
    parts = (
        torch.zeros(ROWS, 2, device=device),
        torch.ones(ROWS, 2, device=device),
        torch.zeros(ROWS, 2, device=device),
    )
    smoothing = LossOptions(label_smoothing=0.1)
    with pytest.raises(ValueError, match="class weights and label smoothing"):
        call_rows(ce_rows_triton, logits, labels, smoothing, partials=parts, class_weight=cw)
    for fn in (ce_rows_torch, ce_rows_triton):
        with pytest.raises(ValueError, match="lse_in"):
            call_rows(
                fn,
                logits,
                labels,
                LossOptions(),
                lse_in=lse,
                outputs=RowOutputs(entropy=torch.empty(ROWS, device=device)),
            )
        with pytest.raises(ValueError, match="class weights"):
            call_rows(fn, logits, labels, LossOptions(), class_weight=ClassWeight(cw.weight[:-1], cw.total))
        with pytest.raises(ValueError, match="class weights"):
            call_rows(
                fn, logits, labels, LossOptions(), class_weight=ClassWeight(cw.weight.double(), cw.total)
            )
        with pytest.raises(ValueError, match="class weights"):  # one weight per class of the full rows
            call_rows(
                fn,
                logits[:, :50],
                labels.clamp(max=49),
                LossOptions(),
                lse_in=lse,
                col_offset=0,
                vocab_total=vocab,
                grad=torch.empty(ROWS, 50, device=device),
                coef_ce=lse,
                coef_z=lse,
                class_weight=ClassWeight(cw.weight[:50], cw.total),
            )
    with pytest.raises(ValueError, match="argmax"):
        call_rows(
            ce_rows_triton,
            logits,
            labels,
            LossOptions(),
            outputs=RowOutputs(argmax=torch.empty(ROWS + 1, device=device)),
        )
