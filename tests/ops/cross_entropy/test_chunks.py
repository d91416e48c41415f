"""``chunks.run_chunks``' kept-rows path: when some labels are ignored, the forward passes the
kept rows' index and the token chunks gather those rows only (every GEMM shrinks by the share of
ignored rows). The skipped rows must read exactly as ignored rows: ce = lse = 0, zero grad_h,
argmax -1, entropy and token scale 0.

Then a wider weight's copy in grad_W's bytes, end to end (its pieces: test_grad_weight_layout.py)."""

import dataclasses

import pytest
import torch
from op_helpers import (
    BACKENDS,
    DTYPES,
    IGNORE_PATTERNS,
    TOL,
    check_parity,
    chunk_call,
    make_case,
    record_calls,
)

import liger_patch as lp
from liger_patch.ops.core.tuning import Tuning
from liger_patch.ops.cross_entropy import chunks as chunked
from liger_patch.ops.cross_entropy import operator as flce_operator
from liger_patch.ops.cross_entropy.backends import row_backend
from liger_patch.ops.cross_entropy.options import LossOptions
from liger_patch.ops.cross_entropy.row_io import RowOutputs


@pytest.fixture
def row_indexes(monkeypatch):
    """The ``row_index`` of every ``run_chunks`` call (``None`` when every row is walked)."""
    return record_calls(
        monkeypatch, flce_operator, "run_chunks", lambda args, kwargs, result: args[0].row_index
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore", IGNORE_PATTERNS + ["all"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_walks_only_kept_rows(
    gen, device, chunk_rows, row_indexes, backend, ignore, reduction, dtype
):
    # 3 x 17 tokens in 7-row chunks: the gathered rows end in a short chunk too.
    case = make_case(gen, (3, 17), 10, 37, dtype=dtype, device=device, bias=True, ignore=ignore)
    opts = dict(backend=backend, reduction=reduction, z_loss_scale=1e-2, return_z_loss=True)
    tuned = chunk_rows(7, 37)
    tuned["tuning"] = dataclasses.replace(tuned["tuning"], skip_ignored_share=0.0)  # skip any ignored row
    check_parity(case, gen, tol=TOL[dtype], **opts, **tuned)
    kept = (case.labels.reshape(-1) != case.ignore_index).nonzero().view(-1)
    forward_index = row_indexes[0]
    if ignore == "none":
        assert forward_index is None
    else:
        assert torch.equal(forward_index.cpu(), kept.cpu())


@pytest.mark.parametrize(
    "opts",
    [
        dict(use_token_scaling=True),
        dict(label_smoothing=0.1, softcap=4.0, logit_scale=0.8),
        dict(num_items_in_batch=23),
    ],
    ids=str,
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_rows_with_options(gen, device, chunk_rows, row_indexes, backend, opts):
    case = make_case(gen, (41,), 12, 50, device=device, bias=True, ignore="every_other")
    check_parity(case, gen, tol=TOL[torch.float32], backend=backend, **opts, **chunk_rows(6, 50))
    assert row_indexes[0] is not None


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kept_rows_outputs_equal_every_row_outputs(gen, device, row_indexes, backend, reduction):
    """Accuracy, predicted tokens and entropy (and the gradients through the entropy) are the same
    whether the forward skips the ignored rows or walks them all (the all-rows outputs are checked
    against fp64 in test_outputs.py)."""
    case = make_case(gen, (3, 14), 12, 50, device=device, bias=True, ignore="runs")
    flags = dict(return_token_accuracy=True, return_predicted_tokens=True, return_entropy=True)
    results = []
    for share in (0.0, 1.0):
        tuning = Tuning(chunk_rows=5, skip_ignored_share=share, wait_to_skip_gflop=0.0)
        out = lp.fused_linear_cross_entropy(
            case.hidden,
            case.weight,
            case.labels,
            case.bias,
            backend=backend,
            reduction=reduction,
            tuning=tuning,
            **flags,
        )
        (out.loss.sum() + out.entropy.sum()).backward()
        grads = [t.grad.clone() for t in (case.hidden, case.weight, case.bias)]
        for t in (case.hidden, case.weight, case.bias):
            t.grad = None
        results.append([out.loss, out.token_accuracy, out.predicted_tokens, out.entropy, *grads])
    assert row_indexes[0] is not None and row_indexes[1] is None
    for skipped, every in zip(*results, strict=True):
        torch.testing.assert_close(skipped, every, rtol=1e-5, atol=1e-6)


def _run_all_grads(backend, device, hidden, weight, bias, labels, opts, budget_bytes, **extra):
    """``run_chunks`` with every gradient (``extra``: its other keywords): ce, lse, grad_h,
    grad_W, grad_b."""
    coef = (labels != -100).float() * 0.37
    res = chunked.run_chunks(
        chunk_call(
            row_backend(backend, device),
            hidden,
            weight,
            bias,
            labels,
            opts,
            budget_bytes=budget_bytes,
            coef_ce=coef,
            coef_z=coef * 1.5,
            need_hidden=True,
            need_weight=True,
            need_bias=bias is not None,
            **extra,
        )
    )
    return [res.ce, res.lse, res.grad_hidden, res.grad_weight, res.grad_bias]


@pytest.mark.parametrize("backend", BACKENDS)
def test_skipped_rows_read_as_ignored_rows(gen, device, backend):
    """run_chunks with the kept rows' index equals run_chunks over every row, output by output,
    on a strided (non-contiguous) hidden, with grad_W summed over chunks in the weight's dtype."""
    n, h, v = 29, 9, 40
    hidden = torch.randn(n, 2 * h, generator=gen).to(device)[:, ::2]
    weight = torch.randn(v, h, generator=gen).to(device)
    bias = torch.randn(v, generator=gen).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    labels[torch.tensor([0, 3, 4, 5, 17, 28])] = -100
    keep = labels != -100
    opts = LossOptions(
        return_token_accuracy=True,
        return_entropy=True,
        tuning=Tuning(chunk_rows=6, fp32_grad_weight=False),
    )

    def run(row_index):
        outputs = RowOutputs(
            argmax=torch.full((n,), 7, dtype=torch.int64, device=device),  # garbage to overwrite
            entropy=torch.full((n,), 5.0, device=device),
        )
        grads = _run_all_grads(
            backend, device, hidden, weight, bias, labels, opts, 1 << 30, outputs=outputs, row_index=row_index
        )
        return [*grads, *outputs.tensors()[:2]]

    every_row = run(None)
    kept_rows = run(keep.nonzero().view(-1))
    for a, b in zip(every_row, kept_rows, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert (kept_rows[2][~keep] == 0).all() and (kept_rows[5][~keep] == -1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_ignored_gives_zero_grad_weight_not_garbage(gen, device, backend):
    """An empty index runs no chunk: grad_W (summed in the weight's dtype, whose first chunk would
    overwrite) must still be zeros."""
    hidden = torch.randn(8, 6, generator=gen).to(device)
    weight = torch.randn(20, 6, generator=gen).to(device)
    labels = torch.full((8,), -100, device=device)
    res = chunked.run_chunks(
        chunk_call(
            row_backend(backend, device),
            hidden,
            weight,
            None,
            labels,
            LossOptions(tuning=Tuning(fp32_grad_weight=False)),
            budget_bytes=1 << 20,
            coef_ce=torch.zeros(8, device=device),
            coef_z=torch.zeros(8, device=device),
            need_hidden=True,
            need_weight=True,
            row_index=torch.zeros(0, dtype=torch.int64, device=device),
        )
    )
    assert res.grad_weight.abs().sum() == 0 and res.grad_hidden.abs().sum() == 0
    assert res.ce.abs().sum() == 0 and res.lse.abs().sum() == 0


def test_two_pass_plan_walks_every_row(gen, device, chunk_rows, row_indexes):
    """The two-pass path needs every row's hidden states in one tensor: a kept-rows index is
    dropped there, and the result is still exact."""
    case = make_case(gen, (30,), 8, 40, device=device, ignore="half")
    check_parity(case, gen, tol=TOL[torch.float32], backend="torch", **chunk_rows(5, 40, two_pass=True))
    assert row_indexes[0] is not None  # offered by the forward; the plan declines it


@pytest.mark.parametrize(("n_ignored", "skips"), [(0, False), (1, False), (2, True), (39, True), (40, True)])
def test_default_skips_from_five_percent_ignored(gen, device, row_indexes, n_ignored, skips):
    """``Tuning.skip_ignored_share`` (5 %): below it the gathers cost more than the rows they save.
    (``wait_to_skip_gflop`` 0: on CUDA the check is always read, so a call this small skips too.)"""
    case = make_case(gen, (40,), 8, 30, device=device, ignore="none")
    case.labels[torch.randperm(40, generator=gen)[:n_ignored].to(device)] = case.ignore_index
    check_parity(case, gen, tol=TOL[torch.float32], backend="torch", tuning=Tuning(wait_to_skip_gflop=0.0))
    assert (row_indexes[0] is not None) == skips


# ---------------------------------------------------------------- the weight's copy in grad_W's bytes


@pytest.fixture
def widenings(monkeypatch):
    """The dtype each ``widen_in_place`` call widened from (the layout was taken)."""
    return record_calls(monkeypatch, chunked, "widen_in_place", lambda args, kwargs, out: args[1])


@pytest.mark.parametrize(
    "tuning, budget_bytes",
    [
        (Tuning(chunk_rows=5), 1 << 30),  # one pass, 7 chunks
        (Tuning(chunk_rows=5), 96),  # ... with a budget of almost nothing
        (Tuning(chunk_rows=5, two_pass=True), 64 * 37 * 4),  # pass A in grad_W's first half
        (Tuning(chunk_rows=5, fp32_grad_weight=False), 1 << 30),  # summed in the hidden's dtype
    ],
    ids=["one_pass", "one_pass_small_budget", "two_pass", "hidden_dtype_sum"],
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_wider_weight_copy_in_grad_weight_is_exact(
    gen, device, widenings, backend, layout, tuning, budget_bytes
):
    """A weight twice as wide as the GEMMs (fp64 beside fp32 GEMMs here; an fp32 weight under bf16
    autocast on a GPU) has its rounded copy laid over grad_W's second half and grad_W's sum over
    the first, widened in place at the end. Every result must equal, bit for bit, the run on the
    weight rounded beforehand, whose grad_W is the same fp32 sum."""
    n, h, v = 33, 8, 37  # V*H*4 bytes is a multiple of 16: the copy starts on an aligned boundary
    hidden = torch.randn(n, h, generator=gen).to(device)
    if layout == "transposed":
        weight = torch.randn(h, v, generator=gen, dtype=torch.float64).to(device).t()
    elif layout == "strided":
        weight = torch.randn(v, 2 * h, generator=gen, dtype=torch.float64).to(device)[:, ::2]
    else:
        weight = torch.randn(v, h, generator=gen, dtype=torch.float64).to(device)
    bias = torch.randn(v, generator=gen).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    labels[torch.tensor([0, 7, 8, 32])] = -100
    opts = LossOptions(tuning=tuning)
    wide = _run_all_grads(backend, device, hidden, weight, bias, labels, opts, budget_bytes)
    assert widenings == ([] if tuning.two_pass else [torch.float32])
    # the copy is contiguous whatever the weight's layout; so is this one (cuBLAS's results may
    # depend on the operand layout)
    rounded_weight = weight.float().contiguous()
    rounded = _run_all_grads(backend, device, hidden, rounded_weight, bias, labels, opts, budget_bytes)
    assert wide[3].dtype == torch.float64 and wide[3].is_contiguous()
    for name, a, b in zip(["ce", "lse", "grad_h", "grad_W"], wide[:4], rounded[:4], strict=True):
        assert torch.equal(a, b.to(a.dtype)), name
    # pass B's blocks differ (the copy leaves no room in grad_W for wide ones): grad_b's column
    # sums are reduced over other widths, in another order
    torch.testing.assert_close(wide[4], rounded[4], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_copy_outside_grad_weight_when_unaligned(gen, device, widenings, backend):
    """V*H*4 bytes not a multiple of 16 (H=9): the copy cannot start on an aligned boundary in
    grad_W, so it is a tensor of its own, and the results are the same."""
    n, h, v = 20, 9, 37
    hidden = torch.randn(n, h, generator=gen).to(device)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64).to(device)
    labels = torch.randint(0, v, (n,), generator=gen).to(device)
    opts = LossOptions(tuning=Tuning(chunk_rows=6))
    wide = _run_all_grads(backend, device, hidden, weight, None, labels, opts, 1 << 30)
    rounded = _run_all_grads(backend, device, hidden, weight.float(), None, labels, opts, 1 << 30)
    assert widenings == []
    for a, b in zip(wide[:4], rounded[:4], strict=True):
        assert torch.equal(a, b.to(a.dtype))
